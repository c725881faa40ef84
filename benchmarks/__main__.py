"""One entry point for every benchmark: ``python -m benchmarks <command> [its arguments]`` from the repository root.

    python -m benchmarks                      # the commands, one line each
    python -m benchmarks step --help          # a command's own arguments

Each command is one of the scripts in this folder (they share the model presets of ``bench_tree_vs_trajectory``,
the workload presets of ``harts_hf.workloads``, the model FLOPs of ``model_flops`` and the run record of
``run_record``); ``python benchmarks/<script>.py`` runs the same code.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

COMMANDS = {
    "step": ("plan_memory_probe", "fwd+bwd of one batch: tree (whole or planner pieces) vs the packed per-trajectory "
                                  "path, MFU, peak memory, checkpointing, profile (CUDA; the headline rows)"),
    "compare": ("bench_tree_vs_trajectory", "tree vs per-trajectory loop, padded micro-batches and packed path on "
                                            "the workload presets, with the cost fit"),
    "kernels": ("gpu_kernels", "tree kernels op by op: parity against plain calls and timing (GDN, attention, conv, "
                               "fused per-token ops, varlen kernels; CUDA)"),
    "parity": ("gpu_parity", "bf16 parity of tree and per-trajectory paths against fp32 on a model (CUDA)"),
    "suite": ("gpu_suite", "everything the GPU run measures in one process (fla compiles once)"),
    "multi-gpu": ("multi_gpu_tree_grpo", "TreeGRPOTrainer under accelerate on several GPUs: throughput, imbalance, "
                                         "parity with one GPU"),
    "sft": ("sft_step", "TreeSFTTrainer against TRL's SFTTrainer on an agentic workload's rows: seconds per step, "
                        "loss, MFU, peak memory"),
    "calibrate": ("calibrate_cost_model", "fit the planner's cost model to tree timings on this GPU"),
    "refit": ("refit_cost_model", "refit the planner's cost model to committed full-size `step` results, each "
              "workload held out in turn (CPU)"),
    "planner": ("bench_planner", "planner quality against trajectory-level baselines (CPU)"),
    "forests": ("bench_trees", "prefix forest build and pack time on ~1M path tokens (CPU)"),
    "workloads": ("bench_workloads", "every workload preset's forest statistics and build time (CPU)"),
    "attention-kernels": ("attention_kernels", "attention kernels per attended pair at the 2B head shapes (CUDA; the "
                                               "evidence for tree_attention_backend='auto')"),
    "varlen-limits": ("varlen_limits", "torch's flash varlen past 2^31 elements and the split calls (CUDA; the "
                                       "evidence for varlen.MAX_CALL_ELEMENTS)"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:{width}s}  {description}" for name, (_, description) in COMMANDS.items()]
    return "usage: python -m benchmarks <command> [arguments]\n\ncommands:\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return
    if argv[0] not in COMMANDS:
        raise SystemExit(f"python -m benchmarks: unknown command {argv[0]!r}\n\n{usage()}")
    here = Path(__file__).resolve().parent
    for path in (str(here.parent), str(here)):  # the scripts import each other and harts_hf by name
        if path not in sys.path:
            sys.path.insert(0, path)
    module = importlib.import_module(COMMANDS[argv[0]][0])
    saved = sys.argv
    sys.argv = [f"python -m benchmarks {argv[0]}", *argv[1:]]
    try:
        module.main()
    finally:
        sys.argv = saved


if __name__ == "__main__":
    main()
