"""The execution plan of the gated delta rule over a packed forest.

Runs are maximal contiguous chains of the DFS layout (a branch point's first child continues its
parent's run). A run whose first token sits at depth d
restarts from the state at the chunk boundary ``c = C * (d // C)`` of its path and replays the
``d - c`` (< C) ancestor tokens before it, so every path keeps the chunk grid of per-trajectory
training. Runs are grouped into rounds: a round only needs states produced in earlier rounds.

A forest cut out below a branch point (a planner piece: one tree whose root sits at depth ``d0 > 0``) starts
its root run at ``c = C * (d0 // C)`` from an external state (key :data:`CONTEXT_STATE`, zeros when ``c = 0``)
and replays ``d0 - c`` context rows appended after its ``U`` tokens. ``state_requests`` ask for the states
cut-off children of a forest restart from (the state hand-off of the planner).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..._checks import check_int
from ...trees import CHUNK_SIZE, PackedForest

__all__ = ["CONTEXT_STATE", "GatedDeltaPlan", "GatedDeltaRound", "build_gated_delta_plan"]

CONTEXT_STATE = ("context",)  # key of the state handed in from outside the forest (see build_gated_delta_plan)
_EXTERNAL = -2  # source_run of runs that start from CONTEXT_STATE


@dataclass
class GatedDeltaRound:
    """One variable-length call: ``n`` execution units laid out back to back.

    ``token_index [T]`` (long): packed index of every executed token, replayed ancestors included;
    ``cu_seqlens [n + 1]`` (int32): unit boundaries in ``token_index``; ``initial_state [n]``: the key of the
    state each unit starts from (``None`` = zeros, :data:`CONTEXT_STATE` = handed in); ``output_position [O]`` / ``output_token [O]`` (long): which
    executed positions are the units' own tokens and where their outputs go in the packed layout;
    ``saved_states``: ``(unit, chunks, key)`` — after ``chunks`` chunks of ``unit``, store the state under ``key``;
    ``chunk_indices [NT, 2]`` (long): (unit, chunk within unit) of every chunk, the varlen kernels' grid, built
    on the host so the fla backend never reads ``cu_seqlens`` back from the device.
    """

    token_index: torch.Tensor
    cu_seqlens: torch.Tensor
    initial_state: list
    output_position: torch.Tensor
    output_token: torch.Tensor
    saved_states: list
    unit_ids: list
    chunk_indices: torch.Tensor | None = None

    @property
    def num_units(self) -> int:
        return len(self.initial_state)

    def to(self, device) -> GatedDeltaRound:
        return GatedDeltaRound(
            self.token_index.to(device), self.cu_seqlens.to(device), self.initial_state,
            self.output_position.to(device), self.output_token.to(device), self.saved_states, self.unit_ids,
            None if self.chunk_indices is None else self.chunk_indices.to(device))


@dataclass
class GatedDeltaPlan:
    """Rounds of execution units for one packed forest; see :func:`build_gated_delta_plan`.

    ``context_tokens``: replayed context rows expected after the ``num_tokens`` packed rows; ``requested_states``:
    one state key per ``state_requests`` entry (``None`` = zeros)."""

    chunk_size: int
    num_tokens: int
    rounds: list[GatedDeltaRound]
    stats: dict = field(default_factory=dict)
    context_tokens: int = 0
    requested_states: list = field(default_factory=list)

    @property
    def needs_context(self) -> bool:
        """True when some unit starts from :data:`CONTEXT_STATE` or replays context rows."""
        return self.context_tokens > 0 or any(key == CONTEXT_STATE for r in self.rounds for key in r.initial_state)

    def to(self, device) -> GatedDeltaPlan:
        return GatedDeltaPlan(self.chunk_size, self.num_tokens, [r.to(device) for r in self.rounds], dict(self.stats),
                              self.context_tokens, list(self.requested_states))

    def executed_view(self) -> GatedDeltaPlan:
        """This plan over its own executed positions: its rounds, units, states and chunk grid, each position a row
        of its own that its unit outputs (replayed ancestors included), so ``num_tokens`` is the executed count and
        nothing is gathered or replayed. The plan of a mixer whose inputs already are in the executed layout
        (:mod:`.executed`). Only for a plan without hand-off context rows; cached."""
        view = self.__dict__.get("_executed_view")
        if view is not None:
            return view
        if self.context_tokens:
            raise ValueError("executed_view: the plan replays hand-off context rows, which have no executed rows")
        rounds, offset = [], 0
        for round_ in self.rounds:
            count = round_.token_index.shape[0]
            device = round_.token_index.device
            rounds.append(GatedDeltaRound(
                token_index=torch.arange(offset, offset + count, device=device),
                cu_seqlens=round_.cu_seqlens, initial_state=round_.initial_state,
                output_position=torch.arange(count, device=device),
                output_token=torch.arange(offset, offset + count, device=device),
                saved_states=round_.saved_states, unit_ids=round_.unit_ids, chunk_indices=round_.chunk_indices))
            offset += count
        view = GatedDeltaPlan(self.chunk_size, offset, rounds, dict(self.stats, replay_tokens=0), 0,
                              list(self.requested_states))
        self.__dict__["_executed_view"] = view
        return view


def build_gated_delta_plan(packed: PackedForest, *, chunk_size: int = CHUNK_SIZE,
                           final_states_only: bool = False, state_requests=()) -> GatedDeltaPlan:
    """Plan the gated delta rule over ``packed`` (host-side, linear in runs + replay tokens).

    ``final_states_only``: a backend that only returns the final state of each sequence (fla's varlen call)
    gets runs cut at every chunk boundary a child restarts from; otherwise intermediate chunk states are
    read out of one longer unit.

    A root at depth ``d0 > 0`` (a piece cut out below a branch point; every root of the forest then sits at that
    depth below the same branch token) restarts at ``c = C * (d0 // C)`` from :data:`CONTEXT_STATE` and replays
    context rows ``U .. U + d0 - c - 1`` (the post-conv inputs of its ancestors at depths ``c .. d0 - 1``, appended
    after the packed rows; each root replays them).

    ``state_requests``: packed tokens ``b``; for each, the state a run starting right below ``b`` would restart
    from (at ``C * ((depth[b] + 1) // C)`` on ``b``'s path) is kept; its key is in ``plan.requested_states``.
    """
    chunk_size = check_int(chunk_size, "build_gated_delta_plan: chunk_size")
    parent = packed.parent.cpu().numpy()
    depth = packed.position_ids.cpu().numpy()
    num_tokens = parent.shape[0]
    roots = np.flatnonzero(parent < 0)
    root_depth = int(depth[roots].max()) if roots.size else 0
    if root_depth > 0 and bool((depth[roots] != root_depth).any()):
        raise ValueError(f"a forest with a root at depth {root_depth} (pieces cut out below a branch point) must have "
                         f"every root at that depth, below the same branch token; got roots at depths "
                         f"{sorted(set(depth[roots].tolist()))}. Plan each cut-off piece on its own.")
    context_tokens = root_depth % chunk_size
    walk_parent = parent  # parents for replay walks: the context rows continue the root's path upwards
    if context_tokens:
        walk_parent = np.concatenate([parent, np.arange(num_tokens - 1, num_tokens + context_tokens - 1)])
        walk_parent[num_tokens] = -1
        walk_parent[roots] = num_tokens + context_tokens - 1  # every root continues the same context path
    state_requests = [int(b) for b in state_requests]
    if any(not 0 <= b < num_tokens for b in state_requests):
        raise ValueError(f"state_requests must be packed token indices in [0, {num_tokens}), got {state_requests}")

    # runs: contiguous chains in the DFS layout; a branch point's first child continues its parent's run,
    # every other child (and every root) starts a run of its own
    starts_mask = (parent < 0) | (parent != np.arange(num_tokens) - 1)
    run_start = np.flatnonzero(starts_mask)
    run_end = np.append(run_start[1:], num_tokens)
    num_runs = run_start.shape[0]
    run_of_token = np.repeat(np.arange(num_runs), run_end - run_start)

    start_depth = depth[run_start]
    end_depth = depth[run_end - 1] + 1
    exec_start = (start_depth // chunk_size) * chunk_size  # c: the chunk boundary each run restarts from
    parent_token = parent[run_start]
    parent_run = np.where(parent_token >= 0, run_of_token[np.maximum(parent_token, 0)], -1)

    # where each run's initial state comes from: zeros, the same state as its parent run's, or
    # the state after some whole chunks of its parent run's execution
    source_run = np.full(num_runs, -1)
    source_chunks = np.zeros(num_runs, dtype=np.int64)
    requests: list[list[int]] = [[] for _ in range(num_runs)]
    for r in range(num_runs):  # preorder: a parent run is resolved before its children
        a = parent_run[r]
        if a < 0:
            if exec_start[r] > 0:
                source_run[r] = _EXTERNAL
            continue
        if exec_start[r] == exec_start[a]:
            source_run[r], source_chunks[r] = source_run[a], source_chunks[a]
        else:
            chunks = (exec_start[r] - exec_start[a]) // chunk_size
            source_run[r], source_chunks[r] = a, chunks
            requests[a].append(int(chunks))
    requested_sources = []  # per state request: (source run, chunks) as for a run starting below b
    for b in state_requests:
        a = run_of_token[b]
        boundary = ((depth[b] + 1) // chunk_size) * chunk_size
        if boundary == exec_start[a]:
            requested_sources.append((int(source_run[a]), int(source_chunks[a])))
        else:
            chunks = int((boundary - exec_start[a]) // chunk_size)
            requested_sources.append((int(a), chunks))
            requests[a].append(chunks)

    # execution units: a run, or with final_states_only the pieces of a run cut at requested boundaries;
    # a state is named by (unit, whole chunks executed in it), with None for the unit's final state
    units = []  # (run, first chunk, end chunk or None for the run's end)
    state_of_request = {}  # (run, chunks) -> (unit, chunks within the unit or None)
    for r in range(num_runs):
        cuts = sorted(set(requests[r]))
        length = end_depth[r] - exec_start[r]
        if final_states_only:
            inner = [c for c in cuts if c * chunk_size < length]
            piece_starts = [0] + inner
            base = len(units)
            for i, first in enumerate(piece_starts):
                units.append((r, first, piece_starts[i + 1] if i + 1 < len(piece_starts) else None))
            for c in cuts:
                piece = inner.index(c) if c in inner else len(piece_starts) - 1
                state_of_request[(r, c)] = (base + piece, None)
        else:
            units.append((r, 0, None))
            for c in cuts:
                state_of_request[(r, c)] = (len(units) - 1, c)

    # rounds: a unit runs one round after the unit that produces its initial state
    unit_round = np.zeros(len(units), dtype=np.int64)
    unit_init: list = [None] * len(units)
    saved_by_unit: dict[int, set] = {}
    for u, (r, first, _) in enumerate(units):
        if first == 0:
            if source_run[r] >= 0:
                unit_init[u] = state_of_request[(int(source_run[r]), int(source_chunks[r]))]
        else:
            unit_init[u] = (u - 1, None)  # the previous piece's final state
        if unit_init[u] is not None:
            source, chunks = unit_init[u]
            unit_round[u] = unit_round[source] + 1
            saved_by_unit.setdefault(source, set()).add(chunks)
    requested_states = []
    for source_of_state, chunks in requested_sources:
        if source_of_state == _EXTERNAL:
            requested_states.append(CONTEXT_STATE)
        elif source_of_state < 0:
            requested_states.append(None)
        else:
            unit, unit_chunks = state_of_request[(source_of_state, chunks)]
            saved_by_unit.setdefault(unit, set()).add(unit_chunks)
            requested_states.append(("state", unit, unit_chunks))

    # per unit: executed packed tokens = replayed ancestors (only in a run's first unit) + own tokens
    replay = start_depth - exec_start
    replay_index = _replay_index(walk_parent, run_start, replay)
    rounds_units: dict[int, list[int]] = {}
    for u in range(len(units)):
        rounds_units.setdefault(int(unit_round[u]), []).append(u)

    rounds = []
    total_replay = 0
    for k in sorted(rounds_units):
        token_parts, output_position, output_token, cu = [], [], [], [0]
        initial, saved, unit_ids = [], [], []
        for slot, u in enumerate(rounds_units[k]):
            r, first, last = units[u]
            own_from = run_start[r] + max(0, first * chunk_size - replay[r])
            own_to = run_end[r] if last is None else run_start[r] + last * chunk_size - replay[r]
            skip = replay[r] if first == 0 else 0
            parts = [replay_index[r]] if skip > 0 else []
            parts.append(np.arange(own_from, own_to))
            executed = np.concatenate(parts)
            total_replay += int(skip)
            output_position.append(cu[-1] + skip + np.arange(own_to - own_from))
            output_token.append(np.arange(own_from, own_to))
            token_parts.append(executed)
            cu.append(cu[-1] + executed.shape[0])
            if first == 0 and source_run[r] == _EXTERNAL:
                initial.append(CONTEXT_STATE)
            else:
                initial.append(None if unit_init[u] is None else ("state",) + tuple(unit_init[u]))
            for chunks in sorted(saved_by_unit.get(u, ()), key=lambda c: -1 if c is None else c):
                saved.append((slot, chunks, ("state", u, chunks)))
            unit_ids.append(u)
        rounds.append(GatedDeltaRound(
            token_index=torch.from_numpy(np.concatenate(token_parts).astype(np.int64)),
            cu_seqlens=torch.tensor(cu, dtype=torch.int32),
            initial_state=initial,
            output_position=torch.from_numpy(np.concatenate(output_position).astype(np.int64)),
            output_token=torch.from_numpy(np.concatenate(output_token).astype(np.int64)),
            saved_states=saved,
            unit_ids=unit_ids,
            chunk_indices=_chunk_indices(np.diff(cu), chunk_size),
        ))
    stats = {
        "runs": int(num_runs),
        "units": len(units),
        "rounds": len(rounds),
        "replay_tokens": int(total_replay),
        "max_replay": int(replay.max()) if num_runs else 0,
        "executed_tokens": int(sum(r.token_index.shape[0] for r in rounds)),
    }
    return GatedDeltaPlan(chunk_size, num_tokens, rounds, stats, context_tokens, requested_states)


def _chunk_indices(lengths: np.ndarray, chunk_size: int) -> torch.Tensor:
    """``[NT, 2]``: (unit, chunk index within the unit) for every chunk of units of ``lengths`` tokens."""
    counts = (lengths + chunk_size - 1) // chunk_size
    unit = np.repeat(np.arange(counts.shape[0]), counts)
    within = np.arange(unit.shape[0]) - np.repeat(np.cumsum(counts) - counts, counts)
    return torch.from_numpy(np.stack([unit, within], 1).astype(np.int64))


def _replay_index(parent: np.ndarray, run_start: np.ndarray, replay: np.ndarray) -> list[np.ndarray]:
    """For every run, the packed indices of its ``replay`` ancestor tokens, oldest first (vectorised walk)."""
    max_replay = int(replay.max()) if replay.size else 0
    walk = np.empty((max_replay, run_start.shape[0]), dtype=np.int64)
    current = run_start.copy()
    for step in range(max_replay):
        current = np.where(current >= 0, parent[np.maximum(current, 0)], -1)
        walk[step] = current
    return [walk[: replay[r], r][::-1].copy() for r in range(run_start.shape[0])]
