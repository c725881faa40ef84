"""Generate every workload preset, then time its PrefixForest build + pack and print its forest statistics.

    python benchmarks/bench_workloads.py [--scales 1.0 0.05] [--seeds 0 1 2] [--presets swe tau] [--out DIR]

With ``--out``, every row (and the documented R_tok range per preset) goes to ``DIR/workloads.json`` beside the run
record (``DIR/run.json``).
"""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from harts_hf.workloads import PRESETS, make_workload

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: the benchmarks' shared modules
from run_record import write_run_record  # noqa: E402

COLUMNS = ("sequences", "path_tokens", "unique_tokens", "R_tok", "R_att", "depth_segments", "branch_points",
           "unaligned_branch_points")


def measure(name: str, scale: float, seed: int) -> dict:
    start = time.perf_counter()
    workload = make_workload(name, scale=scale, seed=seed)
    generated = time.perf_counter()
    forest = workload.forest()
    built = time.perf_counter()
    stats = forest.pack().stats()
    packed = time.perf_counter()
    return {**{key: stats[key] for key in COLUMNS}, "gen_s": generated - start, "build_s": built - generated,
            "pack_s": packed - built}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scales", type=float, nargs="+", default=[1.0, 0.05])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--presets", nargs="+", default=list(PRESETS), choices=list(PRESETS))
    parser.add_argument("--out", default=None, help="folder for workloads.json (every row) and run.json")
    args = parser.parse_args()
    records = []

    header = (f"{'preset':12s} {'scale':>5s} {'seed':>4s} {'seqs':>5s} {'path':>9s} {'unique':>8s} {'R_tok':>6s} "
              f"{'R_att':>6s} {'depth':>5s} {'branch':>6s} {'unalig':>6s} {'gen s':>6s} {'build s':>7s} {'pack s':>6s}")
    print(header)
    for name in args.presets:
        low, high = PRESETS[name].r_tok_range
        for scale in args.scales:
            rows = [measure(name, scale, seed) for seed in args.seeds]
            for seed, row in zip(args.seeds, rows):
                records.append(dict(row, preset=name, scale=scale, seed=seed, documented_r_tok=[low, high]))
                print(f"{name:12s} {scale:5g} {seed:4d} {row['sequences']:5d} {row['path_tokens']:9d} "
                      f"{row['unique_tokens']:8d} {row['R_tok']:6.2f} {row['R_att']:6.2f} {row['depth_segments']:5d} "
                      f"{row['branch_points']:6d} {row['unaligned_branch_points']:6d} {row['gen_s']:6.3f} "
                      f"{row['build_s']:7.3f} {row['pack_s']:6.3f}")
            r_tok = np.array([row["R_tok"] for row in rows])
            inside = ((r_tok >= low) & (r_tok <= high)).sum()
            print(f"{'':12s} {scale:5g} mean R_tok {r_tok.mean():.2f}, documented range [{low}, {high}], "
                  f"{inside}/{len(rows)} seeds inside")
    if args.out is not None:
        write_run_record(Path(args.out))
        (Path(args.out) / "workloads.json").write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
