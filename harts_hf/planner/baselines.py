"""Placement baselines the planner is compared with (benchmarks only): trajectories, not trees, are the unit.

- ``lpt_by_tokens``: longest-processing-time first over whole trajectories by token count;
- ``dfs_threshold_cuts``: trajectories in depth-first (lexicographic) order cut into contiguous runs, the
  threshold on a run's unique tokens found by binary search (the balancer of AReaL's dynamic tree attention).
A prefix shared by trajectories on different replicas is computed on each of them (duplicated tokens).
"""

from __future__ import annotations

__all__ = ["common_prefix_length", "dfs_threshold_cuts", "lpt_by_tokens", "unique_tokens_of"]


def common_prefix_length(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def unique_tokens_of(sequences: list[list[int]]) -> int:
    """Unique tokens of the prefix forest of ``sequences`` (sorted order: each adds its length minus the LCP)."""
    ordered = sorted(sequences)
    return sum(len(s) - (common_prefix_length(s, ordered[i - 1]) if i else 0) for i, s in enumerate(ordered))


def lpt_by_tokens(sequences: list[list[int]], num_replicas: int) -> list[list[int]]:
    """Indices of the sequences on each replica."""
    loads = [0] * num_replicas
    replicas: list[list[int]] = [[] for _ in range(num_replicas)]
    for i in sorted(range(len(sequences)), key=lambda i: (-len(sequences[i]), i)):
        r = min(range(num_replicas), key=lambda r: (loads[r], r))
        replicas[r].append(i)
        loads[r] += len(sequences[i])
    return replicas


def dfs_threshold_cuts(sequences: list[list[int]], num_replicas: int) -> list[list[int]]:
    """Contiguous runs of the depth-first order, the smallest threshold on unique tokens per run that needs at
    most ``num_replicas`` runs."""
    order = sorted(range(len(sequences)), key=lambda i: sequences[i])
    added = [len(sequences[i]) - (common_prefix_length(sequences[i], sequences[order[k - 1]]) if k else 0)
             for k, i in enumerate(order)]

    def cuts(threshold: int) -> list[list[int]] | None:
        runs, current, load = [], [], 0
        for k, i in enumerate(order):
            cost = len(sequences[i]) if not current else added[k]
            if current and load + cost > threshold:
                runs.append(current)
                current, load, cost = [], 0, len(sequences[i])
            current.append(i)
            load += cost
        runs.append(current)
        return runs if len(runs) <= num_replicas else None

    low, high = max(len(s) for s in sequences), sum(len(s) for s in sequences)
    while low < high:
        middle = (low + high) // 2
        if cuts(middle) is None:
            low = middle + 1
        else:
            high = middle
    runs = cuts(low)
    return runs + [[] for _ in range(num_replicas - len(runs))]
