"""TreeSFTTrainer against TRL's SFTTrainer on the rows of an agentic workload preset: seconds per optimizer step,
loss, MFU, peak memory.

    python -m benchmarks sft --preset 2b --workload tau --scale 1.0 --steps 3 --warmup 1 --trainer tree --out results/sft/tree
    python -m benchmarks sft --preset 2b --workload tau --scale 1.0 --steps 3 --warmup 1 --trainer trl --batch 4 \
        --out results/sft/trl
    python -m benchmarks sft --preset 2b --workload tau --scale 1.0 --steps 3 --warmup 1 --trainer packed --batch 8 \
        --out results/sft/packed
    python -m benchmarks sft --preset tiny --workload tau --scale 0.01 --steps 2 --out /tmp/sft   # CPU smoke run
    python -m benchmarks sft --preset 2b --workload tau --scale 0.5 --steps 4 --warmup 2 --trainer tree packed \
        --batch 4 --out results/sft   # both in one process: OUT/tree, OUT/packed
    python -m benchmarks sft --preset 2b --workload tau --scale 0.1 --steps 3 --warmup 1 --trainer tree packed trl \
        --batch 4 --packed-batch 0 --liger --out results/sft   # packed: a step's rows in one call; trl: 4 per batch

Data: optimizer step ``s`` trains one instance of the preset (``make_workload(workload, scale, seed=s)``), every
trajectory a row whose loss is on the tokens the preset marks (thinking and actions; observations and prompts carry
none), as SFT on agent traces trains each assistant turn with its history: the presets drop earlier turns' thinking,
so a conversation's rows fork where that thinking started, and all rows share the system prompt. Every step keeps
the first ``R`` rows of its instance (``R``: the smallest instance's row count, rounded down to a multiple of
``--batch`` and ``--packed-batch``), so every trainer sees the same
micro-batches in the same order (no shuffling). The rows are handed to the trainers pre-tokenized
(``input_ids``, ``assistant_masks``; TRL turns the mask into labels).

- ``--trainer tree``: TreeSFTTrainer, the ``R`` rows of a step as one prefix forest (one micro-batch).
- ``--trainer packed``: the packed per-row path with the tree's kernels: TreeSFTTrainer with every row its own tree
  (no token shared), micro-batches of ``--packed-batch`` rows (default ``--batch``; 0: all of a step's rows, one
  call) packed without padding, gradient accumulation over the step.
- ``--trainer trl``: TRL's SFTTrainer, micro-batches of ``--batch`` rows padded to their longest (or to a multiple
  of ``--pad-to-multiple-of``), gradient accumulation over the step's ``R / batch`` micro-batches. Not
  ``padding_free``: transformers' Gated DeltaNet layers do not keep packed sequences apart, so packing would not
  train these rows.

All three: fp32 weights, bf16 autocast and non-reentrant gradient checkpointing on CUDA (fp32 on the CPU), AdamW, the
same learning rate; the per-step losses agree when they train the same rows. The MFU counts the model FLOPs of the work
each trainer does (the tree's unique tokens, the rows' tokens for the others; ``benchmarks/model_flops.py``) over the
step's wall time; the FLOP ratio is the rows' work over the tree's. Writes ``OUT/sft.json`` (per step: seconds, peak GiB,
loss, ``tree/*`` metrics; the mean over the steps after ``--warmup``) and ``OUT/run.json`` (several trainers:
``OUT/<trainer>/``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_tree_vs_trajectory import MODELS, build_model  # noqa: E402
from model_flops import forest_throughput  # noqa: E402
from multi_gpu_tree_grpo import PRESETS, SPECIAL, id_tokenizer  # noqa: E402
from run_record import TritonCompiles, write_run_record  # noqa: E402

WORKLOADS = ("tau", "swe", "coding_agent", "search")


def step_rows(workload: str, scale: float, steps: int, vocab_size: int,
              multiple: int = 1) -> list[list[tuple[list[int], list[int]]]]:
    """Per optimizer step, the ``(input_ids, assistant_masks)`` rows of one instance of the preset (seed = step),
    each step cut to the smallest instance's row count rounded down to a ``multiple`` (TRL's micro-batch)."""
    from harts_hf.workloads import make_workload

    instances = []
    for step in range(steps):
        generated = make_workload(workload, scale=scale, seed=step, vocab_size=vocab_size - len(SPECIAL))
        instances.append([(list(map(int, sequence)), [int(bool(m)) for m in mask])
                          for sequence, mask in zip(generated.sequences, generated.loss_masks)])
    rows = min(map(len, instances)) // multiple * multiple
    return [instance[:rows] for instance in instances]


def micro_batch(args, per_step: int) -> int:
    """Rows per micro-batch of ``args.trainer``: the step's rows for the tree, ``--packed-batch`` for the packed
    path (0: the step's rows, one packed call per step; unset: ``--batch``), ``--batch`` for TRL."""
    if args.trainer == "tree" or (args.trainer == "packed" and args.packed_batch == 0):
        return per_step
    if args.trainer == "packed" and args.packed_batch is not None:
        return args.packed_batch
    return args.batch


def row_multiple(args) -> int:
    """What every step's row count is rounded down to, so that each trainer's micro-batches divide it."""
    return math.lcm(args.batch, args.packed_batch or 1)


def make_trainer(args, model, rows: list[list[tuple[list[int], list[int]]]], device: torch.device):
    """TreeSFTTrainer (``tree``, or ``packed``: no row shares a token) or TRL's SFTTrainer over ``rows`` in order, one
    optimizer step per instance."""
    from datasets import Dataset
    from torch.utils.data import SequentialSampler
    from trl import SFTConfig, SFTTrainer

    from harts_hf import TreeSFTConfig, TreeSFTTrainer
    from harts_hf.trees import PrefixForest

    per_step = len(rows[0])
    batch = micro_batch(args, per_step)
    flat = [row for step in rows for row in step]
    dataset = Dataset.from_dict({"input_ids": [ids for ids, _ in flat], "assistant_masks": [m for _, m in flat]})
    on_cuda = device.type == "cuda"
    common = dict(output_dir=str(Path(args.out) / "trainer"), per_device_train_batch_size=batch,
                  gradient_accumulation_steps=per_step // batch, max_steps=len(rows), learning_rate=1e-5,
                  logging_steps=1, save_strategy="no", report_to="none", max_length=None, bf16=on_cuda,
                  use_cpu=not on_cuda, gradient_checkpointing=True,
                  gradient_checkpointing_kwargs={"use_reentrant": False}, dataloader_num_workers=0, seed=0)
    config, trainer_class = (SFTConfig, SFTTrainer) if args.trainer == "trl" else (TreeSFTConfig, TreeSFTTrainer)
    if args.trainer != "trl":
        common["tree_varlen_kernel"] = args.varlen_kernel
    else:
        common["use_liger_kernel"] = args.liger
        if args.pad_to_multiple_of is not None:
            common["pad_to_multiple_of"] = args.pad_to_multiple_of

    class InOrder(trainer_class):  # the rows in dataset order: micro-batch k of every run holds the same rows
        def _get_train_sampler(self, *unused, **kwargs):
            return SequentialSampler(self.train_dataset)

        if args.trainer == "packed":
            def _microbatch_forest(self, rows, masks):  # every row its own tree: packing without sharing
                return PrefixForest.from_sequences(rows, loss_masks=masks, groups=list(range(len(rows))))

    if not on_cuda and args.trainer == "trl":  # SFTTrainer's plain forwards on CPU stay off Triton (CUDA torch)
        from harts_hf.model_patches import cpu_safe

        cpu_safe(model)
    tokenizer = id_tokenizer(model.config.vocab_size)
    return InOrder(model=model, args=config(**common), train_dataset=dataset, processing_class=tokenizer)


def step_timer(trainer, records: list):
    """Callback: wall time (CUDA-synchronised), peak memory and Triton compilations of every optimizer step."""
    from transformers import TrainerCallback

    device = trainer.accelerator.device
    compiles = TritonCompiles()

    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            synchronize()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            compiles.take()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            synchronize()
            peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
            records.append(dict(step=state.global_step, seconds=time.perf_counter() - self.start, peak_gib=peak,
                                triton_compiles=compiles.take()))

    return StepTimer()


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="model: tiny or the 2.3B preset")
    parser.add_argument("--workload", choices=WORKLOADS, default="tau")
    parser.add_argument("--scale", type=float, default=0.01)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps (one workload instance each)")
    parser.add_argument("--warmup", type=int, default=1, help="first steps left out of the mean (compilation)")
    parser.add_argument("--trainer", nargs="+", choices=["tree", "packed", "trl"], default=["tree"],
                        help="one or several, one after the other in this process (a fresh model each, the same "
                             "seed; kernels compiled and autotuned once), each written to OUT/<trainer>")
    parser.add_argument("--batch", type=int, default=4, help="micro-batch size (rows) of trl and packed; the tree "
                                                             "takes a step's rows as one micro-batch")
    parser.add_argument("--packed-batch", type=int, default=None, metavar="ROWS",
                        help="micro-batch size (rows) of packed alone (default: --batch); 0: a step's rows in one "
                             "packed call, the strongest per-row packing where it fits in memory (the fwd+bwd "
                             "headline's packed path), while trl keeps --batch")
    parser.add_argument("--varlen-kernel", default=None, choices=["torch", "fa4", "auto"],
                        help="tree_varlen_kernel of tree and packed (default: harts_hf's, torch)")
    parser.add_argument("--pad-to-multiple-of", type=int, default=None, metavar="TOKENS",
                        help="TRL's SFTConfig.pad_to_multiple_of: each micro-batch padded to a multiple of TOKENS, so "
                             "new batch widths compile fewer kernel variants (default: TRL's, the longest row)")
    parser.add_argument("--liger", action="store_true",
                        help="trl: SFTConfig.use_liger_kernel=True (Liger's fused linear cross-entropy and layer "
                             "kernels), what a careful TRL user turns on; needs liger-kernel (tree and packed have "
                             "fused kernels of their own)")
    parser.add_argument("--out", default="results/sft")
    args = parser.parse_args(argv)
    if args.packed_batch is not None and (args.packed_batch < 0 or "packed" not in args.trainer):
        parser.error(f"--packed-batch {args.packed_batch}: the packed path's rows per micro-batch, >= 0 (0: a step's "
                     "rows), with packed in --trainer")
    if args.batch < 1:
        parser.error(f"--batch {args.batch}: rows per micro-batch, at least 1")
    if args.liger and "trl" not in args.trainer:
        parser.error("--liger is SFTConfig.use_liger_kernel for --trainer trl; add trl to --trainer or leave --liger out")
    if args.warmup >= args.steps:
        parser.error(f"--warmup {args.warmup} leaves none of --steps {args.steps} to time: pass more steps than "
                     "warm-up steps")
    return args


def main(argv=None) -> dict[str, dict]:
    """Each ``--trainer`` in turn; their results by name (one trainer: written to OUT, several: OUT/<trainer>)."""
    import gc

    args = parse_args(argv)
    results = {}
    for trainer in args.trainer:
        out = args.out if len(args.trainer) == 1 else str(Path(args.out) / trainer)
        results[trainer] = train_and_time(argparse.Namespace(**{**vars(args), "trainer": trainer, "out": out}))
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return results


def train_and_time(args) -> dict:
    """One trainer (``args.trainer``) over the workload's steps, written to ``args.out``: per-step seconds, peak,
    compilations, loss, MFU."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(args.out)
    write_run_record(out)
    torch.manual_seed(0)
    model = build_model(PRESETS[args.preset], "qwen3_next", device, torch.float32)
    rows = step_rows(args.workload, args.scale, args.steps, MODELS[PRESETS[args.preset]]["vocab_size"],
                     row_multiple(args))
    trainer = make_trainer(args, model, rows, device)
    records: list[dict] = []
    trainer.add_callback(step_timer(trainer, records))
    trainer.train()
    logged = {entry["step"]: entry for entry in trainer.state.log_history if "loss" in entry}

    from harts_hf.trees import PrefixForest

    steps = []
    for record, instance in zip(records, rows):
        stats = PrefixForest.from_sequences([ids for ids, _ in instance]).pack().stats()
        log = logged.get(record["step"], {})
        work = forest_throughput(model, record["seconds"], stats, tree=args.trainer == "tree")
        steps.append(dict(record, loss=log.get("loss"), mean_token_accuracy=log.get("mean_token_accuracy"),
                          tree={k: v for k, v in log.items() if k.startswith("tree/")},
                          rows=len(instance), path_tokens=stats["path_tokens"], unique_tokens=stats["unique_tokens"],
                          R_tok=stats["R_tok"], mfu=work["mfu"], flop_ratio=work["flop_ratio"]))
    measured = [s for s in steps if s["step"] > args.warmup] or steps  # a run cut short of its timed steps
    result = dict(trainer=args.trainer, preset=args.preset, workload=args.workload, scale=args.scale,
                  batch=micro_batch(args, len(rows[0])), device=str(device), steps=steps,
                  measured_steps=[s["step"] for s in measured],
                  mean_step_s=sum(s["seconds"] for s in measured) / len(measured),
                  mean_mfu=sum(s["mfu"] or 0.0 for s in measured) / len(measured))
    (out / "sft.json").write_text(json.dumps(result, indent=1))
    print(f"| {args.trainer} | {args.workload}@{args.scale} | rows/step {len(rows[0])} | "
          f"mean step {result['mean_step_s']:.2f} s over steps {result['measured_steps']} | MFU {result['mean_mfu']:.3f} |")
    for s in steps:
        print(f"  step {s['step']}: {s['seconds']:.2f} s, loss {s['loss']}, R_tok {s['R_tok']:.2f}, "
              f"peak {s['peak_gib']} GiB, Triton compilations {s['triton_compiles']['count']} "
              f"({s['triton_compiles']['seconds']} s)", flush=True)
    return result


if __name__ == "__main__":
    main()
