"""Placement of whole prompt groups on data-parallel replicas: every replica gets the same number of rows
(sequences) and the slowest replica's estimated tree cost is made small (longest-processing-time first under a
row capacity, then improving swaps). Pure python; ``group_cost`` prices one group's prefix forest."""

from __future__ import annotations

import math
from dataclasses import replace

from .._checks import check_int
from ..trees import PrefixForest
from .cost import CostModel
from .plan import plan

__all__ = ["assign_groups", "group_cost", "imbalance"]


def group_cost(sequences, cost_model: CostModel | None = None) -> float:
    """Estimated forward+backward cost of one tree forward over the prefix forest of ``sequences`` (token-id
    lists or 1-D integer tensors): the cost model on its unique tokens, attention pairs, replay, rounds and leaves,
    every tree one piece, without the cost model's fixed cost per microbatch (the groups placed on one process
    share its forward, so that constant is not a group's)."""
    cost_model = replace(cost_model or CostModel(), microbatches=0.0)
    packed = PrefixForest.from_sequences(sequences).pack()
    the_plan = plan(packed, token_budget=packed.num_tokens, cost_model=cost_model)
    return sum(piece.cost for piece in the_plan.pieces)


def imbalance(loads: list[float]) -> float:
    """Largest over mean load (1.0: perfectly balanced, or nothing to do)."""
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0


def assign_groups(sizes: list[int], costs: list[float], num_replicas: int,
                  initial: list[int] | None = None, rounds: int = 200) -> list[int] | None:
    """Replica of every group such that each replica holds ``sum(sizes) / num_replicas`` rows, with a small
    largest replica cost.

    Args:
        sizes: rows (sequences) of each group, positive integers.
        costs: estimated cost of each group, finite and >= 0.
        num_replicas: data-parallel replicas (>= 1); ``sum(sizes)`` must be a multiple of it.
        initial: an equal-row assignment to improve on (e.g. the one the caller already has); the result is
            never worse than it.
        rounds: most improving swaps.

    Returns:
        ``replica[g]`` for every group ``g``, deterministic for the same input; None when no equal-row placement
        was found (longest-processing-time first by cost, then by size, then ``initial``; with groups of one size
        that divides the capacity one always is).
    """
    num_replicas = check_int(num_replicas, "assign_groups: num_replicas")
    if len(sizes) != len(costs):
        raise ValueError(f"sizes has {len(sizes)} groups but costs has {len(costs)}; give one cost per group")
    if any(not isinstance(size, int) or size < 1 for size in sizes):
        raise ValueError(f"sizes must be positive integers (rows per group), got {list(sizes)}")
    if any(not math.isfinite(cost) or cost < 0 for cost in costs):
        raise ValueError(f"costs must be finite and >= 0, got {list(costs)}")
    if sum(sizes) % num_replicas:
        raise ValueError(f"{sum(sizes)} rows cannot be split evenly over {num_replicas} replicas")
    capacity = sum(sizes) // num_replicas
    if initial is not None and not _fills_evenly(initial, sizes, num_replicas, capacity):
        raise ValueError(f"initial {list(initial)} does not give every replica {capacity} rows")

    by_cost = sorted(range(len(sizes)), key=lambda g: (-costs[g], -sizes[g], g))
    by_size = sorted(range(len(sizes)), key=lambda g: (-sizes[g], -costs[g], g))
    candidates = [_longest_first(order, sizes, costs, num_replicas, capacity) for order in (by_cost, by_size)]
    found = next((c for c in candidates if c is not None), None)
    if found is None:
        return None if initial is None else list(initial)
    _swap_down(found, sizes, costs, num_replicas, rounds)
    if initial is not None and _max_load(initial, costs, num_replicas) <= _max_load(found, costs, num_replicas):
        return list(initial)  # ties keep the rows where they are
    return found


def _fills_evenly(replica_of: list[int], sizes: list[int], num_replicas: int, capacity: int) -> bool:
    if len(replica_of) != len(sizes) or any(r not in range(num_replicas) for r in replica_of):
        return False
    rows = [0] * num_replicas
    for group, replica in enumerate(replica_of):
        rows[replica] += sizes[group]
    return all(count == capacity for count in rows)


def _loads(replica_of: list[int], costs: list[float], num_replicas: int) -> list[float]:
    loads = [0.0] * num_replicas
    for group, replica in enumerate(replica_of):
        loads[replica] += costs[group]
    return loads


def _max_load(replica_of, costs, num_replicas) -> float:
    return max(_loads(replica_of, costs, num_replicas))


def _longest_first(order, sizes, costs, num_replicas, capacity) -> list[int] | None:
    """Each group in ``order`` to the least loaded replica with room for it; None if one does not fit."""
    loads, room = [0.0] * num_replicas, [capacity] * num_replicas
    replica_of = [0] * len(sizes)
    for group in order:
        fits = [r for r in range(num_replicas) if room[r] >= sizes[group]]
        if not fits:
            return None
        replica = min(fits, key=lambda r: (loads[r], r))
        replica_of[group] = replica
        loads[replica] += costs[group]
        room[replica] -= sizes[group]
    return replica_of


def _swap_down(replica_of: list[int], sizes, costs, num_replicas: int, rounds: int) -> None:
    """Swap two groups of the same size between the most loaded replica and another while that lowers the larger
    of the two loads (row counts stay equal; deterministic, in place)."""
    for _ in range(rounds):
        loads = _loads(replica_of, costs, num_replicas)
        high = max(range(num_replicas), key=lambda r: (loads[r], -r))
        best = None  # (new larger of the two loads, group out of high, group into high)
        for group in (g for g in range(len(sizes)) if replica_of[g] == high):
            for other in range(len(sizes)):
                low = replica_of[other]
                delta = costs[group] - costs[other]
                if low == high or sizes[other] != sizes[group] or delta <= 0:
                    continue
                candidate = (max(loads[high] - delta, loads[low] + delta), group, other)
                if candidate[0] < loads[high] - 1e-12 * max(loads[high], 1e-300) and (best is None or candidate < best):
                    best = candidate
        if best is None:
            return
        _, group, other = best
        replica_of[group], replica_of[other] = replica_of[other], replica_of[group]
