"""Fit the planner's cost model from measured tree forward+backward times (run it on the GPU you train on).

    python benchmarks/calibrate_cost_model.py --model qwen3_next_2b --out cost_model.json
    python benchmarks/calibrate_cost_model.py --model tiny --device cpu --out /tmp/cost.json   # smoke test

Times one tree forward+backward (gradient checkpointing on) for forests of several shapes and sizes drawn from the
workload presets, reads each forest's features (unique tokens, attention pairs, replay tokens, rounds, leaves),
fits the non-negative coefficients of ``harts_hf.planner.CostModel`` and saves them (the run record beside them, in
``<out>_run.json``); ``CostModel.load(path)`` reads them back for ``plan(..., cost_model=...)``. Prints each
sample's measured and predicted time.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench_tree_vs_trajectory import MODELS, build_model, run_tree, timed
from run_record import run_record

from harts_hf.planner import CostModel
from harts_hf.trees import PrefixForest
from harts_hf.workloads import make_workload


def features_of(stats: dict) -> dict:
    return {"unique_tokens": stats["unique_tokens"], "attention_pairs": stats["tree_attention_pairs"],
            "replay_tokens": stats["gdn_replay_tokens"], "rounds": stats["gdn_rounds"], "leaves": stats["sequences"],
            "microbatches": 1}


def main():
    import torch

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3_next_2b", choices=list(MODELS))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--scales", type=float, nargs="+", default=[0.005, 0.01, 0.02, 0.04])
    parser.add_argument("--presets", nargs="+", default=["swe", "tau", "grpo", "search"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default="cost_model.json")
    args = parser.parse_args()
    device = torch.device(args.device)
    model = build_model(args.model, "qwen3_next", device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    vocab = model.config.vocab_size
    samples, seconds = [], []
    for preset in args.presets:
        for scale in args.scales:
            workload = make_workload(preset, scale=scale, seed=0)
            forest = PrefixForest.from_sequences([[t % vocab for t in s] for s in workload.sequences])
            elapsed, _ = timed(device, lambda f=forest: run_tree(model, f), args.repeats)
            samples.append(features_of(run_tree(model, forest)))
            seconds.append(elapsed)
    fitted = CostModel.fit(samples, seconds)
    fitted.save(args.out)
    record = Path(args.out).with_name(Path(args.out).stem + "_run.json")  # CostModel.load reads only coefficients
    record.write_text(json.dumps(run_record(), indent=1))
    print(f"{'unique':>8s} {'pairs':>12s} {'replay':>7s} {'rounds':>6s} {'measured s':>10s} {'predicted s':>11s}")
    for features, measured in zip(samples, seconds):
        print(f"{features['unique_tokens']:8d} {features['attention_pairs']:12.0f} {features['replay_tokens']:7d} "
              f"{features['rounds']:6d} {measured:10.4f} {fitted.cost(features):11.4f}")
    print(f"saved {fitted} to {args.out}")


if __name__ == "__main__":
    main()
