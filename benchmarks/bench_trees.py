"""Time PrefixForest building and packing on ~1M path tokens (agentic-style sharing and GRPO groups).

    python benchmarks/bench_trees.py [--path-tokens 1000000]
"""

import argparse
import time

import numpy as np

from harts_hf.trees import PrefixForest


def agentic_like(rng, path_tokens: int):
    """A 16k shared system prompt, then trajectories that fork off earlier ones at random depths."""
    system = rng.integers(0, 150000, 16000).tolist()
    sequences, total = [], 0
    while total < path_tokens:
        if sequences and rng.random() < 0.8:
            base = sequences[rng.integers(len(sequences))]
            cut = int(rng.integers(len(system), len(base) + 1))
            sequence = base[:cut] + rng.integers(0, 150000, int(rng.integers(200, 4000))).tolist()
        else:
            sequence = system + rng.integers(0, 150000, int(rng.integers(1000, 8000))).tolist()
        sequences.append(sequence)
        total += len(sequence)
    return sequences


def grpo_like(rng, path_tokens: int):
    sequences, total = [], 0
    while total < path_tokens:
        prompt = rng.integers(0, 150000, 512).tolist()
        for _ in range(8):
            sequences.append(prompt + rng.integers(0, 150000, int(rng.integers(200, 2000))).tolist())
            total += len(sequences[-1])
    return sequences


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--path-tokens", type=int, default=1_000_000)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"{'workload':10s} {'seqs':>6s} {'path':>9s} {'unique':>9s} {'R_tok':>6s} {'build s':>8s} {'pack s':>7s} {'stats s':>8s}")
    for name, make in [("agentic", agentic_like), ("grpo", grpo_like)]:
        sequences = make(rng, args.path_tokens)
        start = time.perf_counter()
        forest = PrefixForest.from_sequences(sequences)
        built = time.perf_counter()
        packed = forest.pack()
        packed_at = time.perf_counter()
        stats = packed.stats()
        done = time.perf_counter()
        print(f"{name:10s} {stats['sequences']:6d} {stats['path_tokens']:9d} {stats['unique_tokens']:9d} "
              f"{stats['R_tok']:6.2f} {built - start:8.3f} {packed_at - built:7.3f} {done - packed_at:8.3f}")


if __name__ == "__main__":
    main()
