"""The planner's placement on several data-parallel ranks, measured one rank after another on one GPU.

Each rank's pieces of :func:`harts_hf.planner.plan` timed inside one :func:`harts_hf.planner.execute_plan` call:
the measured per-rank compute next to the cost model's prediction (``plan_memory_probe.py --replicas``).
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch
from packed_path import sync


class Clock:
    """A point on the device's timeline: a CUDA event (recorded on the stream: no synchronisation) or, on the CPU,
    the host clock; ``seconds_to(later)`` after the work is done."""

    def __init__(self, device):
        if device.type == "cuda":
            self.event = torch.cuda.Event(enable_timing=True)
            self.event.record()
        else:
            self.event, self.time = None, time.perf_counter()

    def seconds_to(self, later: Clock) -> float:
        if self.event is not None:
            return self.event.elapsed_time(later.event) / 1e3
        return later.time - self.time


def replica_balance(model, sequences, budget: int | None, replicas: int, device, attention: str = "auto",
                    runs: int = 2) -> dict:
    """The planner's placement on ``replicas`` data-parallel ranks, measured one rank after another on this device.

    Plans the forest for ``replicas`` replicas (cross-replica hand-offs allowed, the trainer's default) and runs
    every piece here in one :func:`execute_plan` call (hand-offs local), with a clock at each of the executor's
    phase marks: the time from one mark to the next belongs to the piece of the later mark (its preparation, its
    hand-off forward, its forward, its backward), and a rank's seconds are those of the pieces placed on it. The
    last of ``runs`` runs is kept. Measured: each rank's compute; not measured: communication and the waits for a
    hand-off that a rank on another device would see. Returns the predicted (cost model) and measured seconds per
    rank and each's max/mean."""
    from harts_hf.planner import execute_plan, plan
    from harts_hf.planner.execute import _PlanRunner
    from harts_hf.trees import PrefixForest

    packed = PrefixForest.from_sequences(sequences).pack()
    the_plan = plan(packed, num_replicas=replicas, token_budget=budget or packed.num_tokens)
    weights = [torch.zeros(len(s) - 1) for s in sequences]
    original, marks = _PlanRunner._mark, []

    def mark(runner, piece, phase):
        original(runner, piece, phase)
        marks.append((piece.index, Clock(device)))

    _PlanRunner._mark = mark
    try:
        for _ in range(max(runs, 1)):
            marks.clear()
            model.zero_grad(set_to_none=True)
            sync(device)
            start = Clock(device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                execute_plan(model, the_plan, logprob_weights=weights, attention_backend=attention)
            end = Clock(device)
            sync(device)
    finally:
        _PlanRunner._mark = original
    model.zero_grad(set_to_none=True)
    piece_seconds = defaultdict(float)
    previous = start
    for piece, clock in marks:
        piece_seconds[piece] += previous.seconds_to(clock)
        previous = clock
    where = the_plan.replica_of_piece()
    measured = [0.0] * replicas
    for piece, seconds in piece_seconds.items():
        measured[where[piece]] += seconds
    predicted = the_plan.replica_costs()

    def imbalance(values):
        mean = sum(values) / len(values)
        return max(values) / mean if mean > 0 else 1.0

    return dict(replicas=replicas, budget=budget, pieces=len(the_plan.pieces),
                cross_replica_handoffs=the_plan.cross_replica_handoffs(), total_seconds=start.seconds_to(end),
                unattributed_seconds=previous.seconds_to(end), piece_seconds=[piece_seconds[i] for i in
                                                                              range(len(the_plan.pieces))],
                predicted_seconds=predicted, measured_seconds=measured, predicted_imbalance=imbalance(predicted),
                measured_imbalance=imbalance(measured),
                replica_tokens=[sum(the_plan.pieces[i].unique_tokens for mb in slots for i in mb.pieces)
                                for slots in the_plan.replicas],
                piece_tokens=[piece.unique_tokens for piece in the_plan.pieces],
                pieces_per_replica=None)  # the planner's choice (refit_cost_model.py rebuilds the plan from it)
