"""Run by tests/test_distributed.py under `accelerate launch --multi_gpu --num_processes 2` on CPU (gloo), by
tests/test_deepspeed.py under the repository's DeepSpeed ZeRO-2/3 configs, and as one plain process for the
reference over the same global batch.

Trains TreeSFTTrainer (MoE Qwen3-Next with its load-balancing loss, rows sharing a system prefix) for two optimizer
steps of two accumulated microbatches and writes each rank's final parameters and world size to OUT_DIR/rank<k>.pt.
The global batch is 6 rows per microbatch whatever the number of processes (``per_device_train_batch_size`` 6 / N).
Mode ``pieces`` (second argument): no load-balancing loss, ``tree_token_budget`` 150 and rows in order, so that on
2 processes process 0 runs every microbatch as planner pieces and process 1 as one tree forward (each rank records
its microbatches' piece counts, 1 for one forward, and the filler passes each ran). Under DeepSpeed process 1
runs its microbatches as one-piece plans too, padded with filler passes (a piece's backward is a collective). Mode
``pieces`` also evaluates on the same rows in batches of 3 (its eval loss, the mean over batches, is the same for
any number of processes).
"""

import os
import sys
from pathlib import Path

import torch
from accelerate import PartialState
from datasets import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from harts_hf import TreeSFTConfig, TreeSFTTrainer  # noqa: E402
from tests.models import build  # noqa: E402
from tests.test_tree_sft import BASE, SYSTEM, planner_dataset, text_dataset  # noqa: E402
from tests.trl_helpers import char_tokenizer  # noqa: E402


def uneven_dataset() -> Dataset:
    """Three rows with long answers to one question (~210 unique tokens, over the budget of 150), then three short
    ones (~115 tokens, within it), all behind a shared prefix longer than one chunk; twice."""
    short = [f"{SYSTEM * 2}{a}+{b}={a + b}" for a, b in [(3, 4), (8, 8), (40, 2)]]
    return Dataset.from_dict({"text": (planner_dataset()["text"][:3] + short) * 2})


def main(out_dir: str, mode: str | None = None):
    state = PartialState()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    options = dict(router_aux_loss_coef=0.01)
    pieces = []  # per training microbatch (mode "pieces"); 1: it fit the budget, one tree forward (or one piece)
    padding = []  # per training microbatch (mode "pieces"): filler passes run (DeepSpeed)
    if mode == "pieces":  # rows in order: process 0 gets the long rows, process 1 the short ones (one process: all)
        options = dict(router_aux_loss_coef=0.0, tree_token_budget=150, train_sampling_strategy="sequential",
                       per_device_eval_batch_size=3)  # eval batches of 3 rows whatever the number of processes
        record = TreeSFTTrainer._record_metrics

        def recording(self, metrics_mode, log_probs, entropies, correct, stats, rows):
            if metrics_mode == "train":
                pieces.append(stats["pieces"])
            return record(self, metrics_mode, log_probs, entropies, correct, stats, rows)

        TreeSFTTrainer._record_metrics = recording
        compute = TreeSFTTrainer.compute_loss

        def counting(self, *args, **kwargs):  # DeepSpeed: filler passes each training microbatch ran
            self.last_piece_padding = 0
            loss = compute(self, *args, **kwargs)
            if self.model.training:
                padding.append(self.last_piece_padding)
            return loss

        TreeSFTTrainer.compute_loss = counting
    args = TreeSFTConfig(**dict(BASE, output_dir=out_dir, per_device_train_batch_size=6 // world_size,
                                gradient_accumulation_steps=2, max_steps=2, **options))
    dataset = text_dataset() if mode is None else uneven_dataset()
    trainer = TreeSFTTrainer(build("qwen3_next_moe", seed=0), args=args, train_dataset=dataset,
                             processing_class=char_tokenizer())
    trainer.train()
    # mode "pieces": evaluation too (no gradient), the long rows' batches as forward-only pieces (ZeRO-3: padded)
    evaluated = trainer.evaluate(uneven_dataset()) if mode == "pieces" else {}
    from harts_hf.model_patches.core import zero3_enabled

    # under DeepSpeed ZeRO-3 each process holds a shard of every parameter: the logged loss / grad_norm compare
    params = {} if zero3_enabled() else {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    torch.save({"world_size": state.num_processes, "params": params, "logged": logged, "pieces": pieces,
                "padding": padding, "evaluated": evaluated},
               Path(out_dir) / f"rank{state.process_index}.pt")
    trainer.accelerator.end_training()  # destroys the process group: gloo left to the interpreter's exit can abort
    return trainer


if __name__ == "__main__":
    trainer = main(*sys.argv[1:3])
    sys.stdout.flush()  # exit without freeing the DDP reducer (see tests/scripts/two_process_tree_grpo.py)
    sys.stderr.flush()
    os._exit(0)
