"""Planner quality against trajectory-level baselines on generation batches of the workload presets (CPU).

    python benchmarks/bench_planner.py [--budget 65536] [--replicas 1 2 4 8] [--out DIR]

For each preset batch and replica count: max/mean replica cost (default CostModel), duplicated tokens (unique
tokens summed over replicas minus the batch's unique tokens) and planning time (best of 3, one core), for
harts_hf.planner.plan, LPT over trajectories by token count, and DFS-order contiguous cuts with a binary-searched
threshold. Baseline replica cost: the cost of the forest of the trajectories placed on it. With ``--out``, the rows
go to ``DIR/planner.json`` beside the run record (``DIR/run.json``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from harts_hf.planner import CostModel, plan
from harts_hf.planner.baselines import dfs_threshold_cuts, lpt_by_tokens
from harts_hf.trees import PrefixForest
from harts_hf.workloads import make_workload

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: the benchmarks' shared modules
from run_record import write_run_record  # noqa: E402

BATCHES = {"swe": dict(num_tasks=8), "tau": dict(num_tasks=8), "grpo": dict(num_prompts=64)}


def forest_cost(sequences, cost_model: CostModel) -> tuple[float, int]:
    if not sequences:
        return 0.0, 0
    stats = PrefixForest.from_sequences(sequences).stats()
    features = {"unique_tokens": stats["unique_tokens"], "attention_pairs": stats["tree_attention_pairs"],
                "leaves": stats["sequences"], "rounds": stats["depth_segments"], "microbatches": 1}
    return cost_model.cost(features), stats["unique_tokens"]


def best_time(function, *args, repeats=3, **kwargs):
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = function(*args, **kwargs)
        best = min(best, time.perf_counter() - start)
    return best, result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget", type=int, default=65536)
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--out", default=None, help="folder for planner.json (every row) and run.json")
    args = parser.parse_args()
    cost_model = CostModel()
    records = []
    print(f"{'batch':6s} {'seqs':>5s} {'unique':>9s} {'R':>2s} | {'method':10s} {'max/mean':>8s} {'dup tokens':>10s} "
          f"{'plan ms':>8s} {'pieces':>6s} {'slots':>5s}")
    for name, overrides in BATCHES.items():
        workload = make_workload(name, scale=args.scale, seed=0, **overrides)
        sequences = workload.sequences
        packed = PrefixForest.from_sequences(sequences).pack()
        unique = packed.num_tokens
        for replicas in args.replicas:
            seconds, the_plan = best_time(plan, packed, num_replicas=replicas, token_budget=args.budget)
            stats = the_plan.stats()
            rows = [("planner", stats["imbalance"], 0, seconds, stats["pieces"], stats["slots"])]
            for method, place in (("lpt", lpt_by_tokens), ("dfs_cuts", dfs_threshold_cuts)):
                seconds, placement = best_time(place, sequences, replicas)
                costs, uniques = zip(*(forest_cost([sequences[i] for i in rows_], cost_model) for rows_ in placement))
                mean = sum(costs) / len(costs)
                rows.append((method, max(costs) / mean, sum(uniques) - unique, seconds, "-", "-"))
            for method, imbalance, duplicated, seconds, pieces, slots in rows:
                records.append(dict(batch=name, sequences=len(sequences), unique_tokens=unique, replicas=replicas,
                                    method=method, max_over_mean=imbalance, duplicated_tokens=duplicated,
                                    plan_seconds=seconds, pieces=pieces, slots=slots))
                print(f"{name:6s} {len(sequences):5d} {unique:9d} {replicas:2d} | {method:10s} {imbalance:8.3f} "
                      f"{duplicated:10d} {seconds * 1e3:8.1f} {pieces!s:>6s} {slots!s:>5s}")
    if args.out is not None:
        write_run_record(Path(args.out))
        (Path(args.out) / "planner.json").write_text(json.dumps(dict(budget=args.budget, scale=args.scale,
                                                                     rows=records), indent=1))


if __name__ == "__main__":
    main()
