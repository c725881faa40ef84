"""Run by tests/test_distributed.py under `accelerate launch --multi_gpu --num_processes 2` on CPU (gloo).

Trains a few TreeGRPO steps and writes each rank's final parameters and world size to OUT_DIR/rank<k>.pt.
Mode ``groups``: the MoE load-balancing loss, one tree forward per microbatch. Mode ``planner``: a token budget
that some prompts' trees fit and others' do not (ranks run different numbers of pieces, or one tree forward);
also runs as one process over the same global batch (``per_device_train_batch_size`` doubled), for the test to
compare parameters. Mode ``cross`` (``cross_grpo``: loss_type 'grpo'): ``planner`` with
``tree_cross_replica_handoffs`` (on 2 processes, one plan over both processes' rows, pieces of a tree on either
process); ``cross_three``: ``cross`` with 18 rows per microbatch over all processes (3 processes: 6 each, so every
process generates whole prompt groups, as the 1-process reference does). Mode ``balance``: TRL's split gives process 0 the two big trees of every generation batch
(``shuffle_dataset=False``; prompts marked "!" get a long draft); ``tree_balance_replicas`` moves whole groups;
also records the first optimizer step's gradient and the prompts each process trains on; as one process it is
the reference over the same global batch.
Modes ``mixed``, ``mixed_no_checkpointing`` (gradient checkpointing on, TRL's default, or off) and
``mixed_sequence`` (``mixed`` with GSPO's sequence-level importance sampling: the pieces first run forward only):
three optimizer steps in which process 0's microbatches (prompts marked "!", a long draft; ``shuffle_dataset=False``,
no balancing) always exceed ``tree_token_budget`` and run as planner pieces, and process 1's always fit (one tree
forward), so the ranks' DDP forwards differ in every microbatch, the first after a synchronised backward included;
each rank records its piece counts and its DDP wrapper's ``find_unused_parameters`` (False with checkpointing: DDP
then rebuilds its buckets once, a collective in the first forward with gradient after the first synchronised
backward).
"""

import os
import sys
from pathlib import Path

import torch
from accelerate import PartialState
from datasets import Dataset
from transformers import TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import harts_hf.trainers.grpo as grpo_module  # noqa: E402
from harts_hf import TreeGRPOConfig, TreeGRPOTrainer  # noqa: E402
from tests.models import build  # noqa: E402
from tests.trl_helpers import (  # noqa: E402
    char_tokenizer,
    length_reward,
    patch_generate,
    prompt_dataset,
)


def main(out_dir: str, mode: str):
    state = PartialState()
    tokenizer = char_tokenizer()
    model = build("qwen3_next_moe", seed=0)
    common = dict(output_dir=out_dir, num_generations=6, max_completion_length=40, gradient_accumulation_steps=2,
                  max_steps=2, learning_rate=1e-2, optim="sgd", bf16=False, use_cpu=True, report_to="none",
                  logging_steps=1, save_strategy="no", seed=0)
    pieces, held, gradients = [], [], {}
    world_size = int(os.environ.get("WORLD_SIZE", "1"))  # PartialState may not be initialised for 2 processes yet
    dataset = prompt_dataset(16)
    if mode in ("planner", "cross", "cross_grpo", "cross_three") or mode.startswith("mixed"):
        if mode.startswith("mixed"):  # process 0: the marked prompts (pieces); process 1: the others (one forward)
            marker = tokenizer.convert_tokens_to_ids("!")
            model = patch_generate(model, tokenizer, draft_width=lambda prompt: 40 if marker in prompt else 4)
            dataset = Dataset.from_dict({"prompt": [("!" if i % 4 < 2 else "") + f"{i}+{i}=" for i in range(12)]})
            common.update(max_steps=3, max_completion_length=50, shuffle_dataset=False, tree_balance_replicas=False,
                          gradient_checkpointing=mode != "mixed_no_checkpointing")
            if mode == "mixed_sequence":  # GSPO's sequence-level ratio: a forward-only pass over the pieces first
                common.update(importance_sampling_level="sequence")
        else:
            model = patch_generate(model, tokenizer, draft_width=lambda prompt: 30 if sum(prompt) % 2 else 10)
        if mode == "cross_grpo":  # per-row normalisers over each process's own rows
            common["loss_type"] = "grpo"
        rows = 18 if mode == "cross_three" else 12  # per microbatch over all processes
        args = TreeGRPOConfig(**common, per_device_train_batch_size=rows // world_size,
                              router_aux_loss_coef=0.0, tree_token_budget=40 if mode.startswith("mixed") else 30,
                              tree_cross_replica_handoffs=mode.startswith("cross"))
        execute_plan = grpo_module.execute_plan

        def counting(model, the_plan, **kwargs):
            if kwargs.get("loss_fn") is not None:
                if mode.startswith("cross"):  # (pieces here, hand-offs between processes) per microbatch
                    owner = the_plan.replica_of_piece()
                    here = sum(owner[p.index] == kwargs.get("replica", 0) for p in the_plan.pieces)
                    crossing = sum(p.handoff is not None and owner[p.index] != owner[p.handoff.source_piece]
                                   for p in the_plan.pieces)
                    pieces.append((here, crossing))
                else:
                    pieces.append(len(the_plan.pieces))
            return execute_plan(model, the_plan, **kwargs)

        grpo_module.execute_plan = counting
        compute_loss = TreeGRPOTrainer.compute_loss

        def recording(self, model, inputs, **kwargs):  # 1 piece: the microbatch fit the budget (one tree forward)
            before = len(pieces)
            loss = compute_loss(self, model, inputs, **kwargs)
            if len(pieces) == before:
                pieces.append(1)
            return loss

        TreeGRPOTrainer.compute_loss = recording
    elif mode == "balance":
        marker = tokenizer.convert_tokens_to_ids("!")
        model = patch_generate(model, tokenizer, draft_width=lambda prompt: 120 if marker in prompt else 4)
        common.update(max_completion_length=130, max_grad_norm=0.0, loss_type="grpo")
        args = TreeGRPOConfig(**common, per_device_train_batch_size=12 // world_size, router_aux_loss_coef=0.0,
                              shuffle_dataset=False)
        dataset = Dataset.from_dict({"prompt": [("!" if i % 4 < 2 else "") + f"{i}+{i}=" for i in range(8)]})
        balance = TreeGRPOTrainer._balance_replicas

        def recording(self, batch):  # the prompts this process trains on, after the placement
            batch = balance(self, batch)
            held.append(sorted(set(tokenizer.batch_decode(batch["prompt_ids"], skip_special_tokens=True))))
            return batch

        TreeGRPOTrainer._balance_replicas = recording
    else:
        model = patch_generate(model, tokenizer)
        args = TreeGRPOConfig(**common, per_device_train_batch_size=6, router_aux_loss_coef=0.01,
                              tree_keep_groups_together=mode == "groups")
    trainer = TreeGRPOTrainer(model, reward_funcs=length_reward, args=args,
                              train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[FirstGradient(gradients)])
    trainer.train()
    params = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    logged = [entry for entry in trainer.state.log_history if "tree/R_tok" in entry]
    find_unused = getattr(trainer.model_wrapped, "find_unused_parameters", None)  # None: no DDP wrapper
    torch.save({"world_size": state.num_processes, "params": params, "logged": logged, "pieces": pieces,
                "held": held, "gradients": gradients, "find_unused_parameters": find_unused},
               Path(out_dir) / f"rank{state.process_index}.pt")
    trainer.accelerator.end_training()  # destroys the process group: gloo left to the interpreter's exit can abort
    return trainer  # kept alive until os._exit (see the end of this file)


class FirstGradient(TrainerCallback):
    """Keeps every parameter's gradient of the first optimizer step (after DDP's all-reduce)."""

    def __init__(self, gradients: dict):
        self.gradients = gradients

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if not self.gradients:
            for name, p in model.named_parameters():
                if p.grad is not None:
                    self.gradients[name.removeprefix("module.")] = p.grad.detach().clone()


if __name__ == "__main__":
    trainer = main(sys.argv[1], sys.argv[2])
    # exit without freeing anything: freeing the DDP reducer (when main's frame or the interpreter lets go of the
    # trainer) destroys its gloo process group with the GIL held while a gloo worker thread waits for the GIL to free
    # a finished all-gather's tensors (a deadlock, seen in CI under load), or aborts at teardown
    # (pytorch/pytorch#190489); every file is written and the group destroyed by now
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
