"""The gated delta rule's state pass over every unit of a plan in ONE launch per direction (Triton, CUDA).

The round-batched fla node runs fla's state pass once per round (a round holds the units whose initial states
are known), so a plan of R rounds costs R launch-bound calls forward, R in the recomputation and R backward. Here
one program per (value head, block of value columns) walks all units in round order: a unit starts from a row of
the state bank (row 0: zeros), runs its chunks, and writes its final state to its bank row when a later unit or a
request needs it. Columns of the state never mix and a program owns its columns in every bank row, so the only
ordering needed is the program's own (a barrier after each bank write). The backward walks the units in reverse
(children before their parents), adds each unit's initial-state gradient into the bank row it started from and
starts a unit from the gradient accumulated on its final row.

Per chunk the arithmetic is the chunkwise recurrence fla's ``chunk_gated_delta_rule_fwd_h`` / ``_bwd_dhu`` use
(same inputs: ``w``, ``u`` from the WY representation, gates cumulated within chunks in log2 units): forward
``v_new = u - w h``, ``h <- h * 2^g_last + k^T (v_new * 2^(g_last - g))``; backward
``dv2 = dv + (k dh) * 2^(g_last - g)``, ``dh <- dh * 2^g_last + scale (q * 2^g)^T do - w^T dv2``. ``h`` is stored
at every chunk start (the state the chunk's output reads), as fla stores it. Per-channel gates (Kimi Delta
Attention, ``g [1, T, HV, K]``, the node of :mod:`.fla_kda`): ``k`` (and ``q`` in the backward) arrive gated, as fla's
``kg`` / ``qg``, and the state decays per key row: forward ``h <- h * 2^g_last[:, None] + k^T v_new``, backward
``dv2 = dv + k dh``, ``dh <- dh * 2^g_last[:, None] + scale q^T do - w^T dv2``, as fla's state passes with ``gk``.

Trade-off: a program's serial chain is every chunk of every unit (fla's varlen call runs units in parallel), so
this wins while the per-round launch overhead exceeds the chunk steps: small and medium forests with several rounds.
``STATE_PASS`` in :mod:`.fla_backend` selects it (``"auto"``, the default: per plan, by
:func:`.fla_backend.state_pass_for`).

Lanes (``STATE_PASS = "lanes"``): the units split into heavy paths (from each unit on, the child with the longest
chain of chunks below it), each walked by its own programs, one launch per wave (a lane's wave is one more than its
parent unit's lane's); the chain per launch is the longest lane of the wave instead of every chunk of the plan.
Backward: waves in reverse; a lane's first unit adds its initial-state gradient atomically (sibling lanes of one
launch may share the row), the others as before. The serial pass is the one-lane case. Chain per pass (chunk steps,
serial -> lanes): full-size ``tau`` 1,621 -> 417 in 3 waves, full-size ``swe`` 6,802 -> 2,014, tau@0.02 125 -> 13.
How many lanes run at once is bounded by occupancy: compiled offline for sm90 (Triton 3.6, 4 warps, 3 stages) the
kernels take 255 registers per thread (the backward spills) and 29 / 50 KB of shared memory, so about two programs
per SM: ~2 lanes of 128 programs at a time on an H200. Timed there (ninth GPU session): 1.00-1.13x the serial
pass's time, never faster, so ``"auto"`` does not pick it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SerialUnits", "lane_order", "one_save_per_unit", "serial_units", "tree_state_backward",
           "tree_state_forward"]


@dataclass
class SerialUnits:
    """Every unit of every round, on one device: executed-token span ``[bos, eos)``, first chunk of its ``h`` rows,
    the bank row it starts from and the bank row its final state goes to (-1: none); lane ``l`` walks units
    ``lane_start[l] .. lane_start[l + 1] - 1`` in order, and ``waves`` lists each launch's lanes as ``(first, end)``
    (one lane, one wave: the serial pass in round order)."""

    bos: torch.Tensor
    eos: torch.Tensor
    chunk: torch.Tensor
    initial_row: torch.Tensor
    save_row: torch.Tensor
    num_chunks: int
    lane_start: torch.Tensor
    waves: list

    @property
    def num_units(self) -> int:
        return int(self.bos.shape[0])


def lane_order(initial_row: list[int], save_row: list[int], chunks: list[int]) -> tuple[list[int], list[int], list]:
    """Heavy-path lanes of units given in round order (a unit's parent is the unit that saved the bank row it starts
    from; rows no unit saves, zeros or a handed-in state, start a root): returns the unit order (lane after lane,
    wave after wave; a lane's units parent first), ``lane_start`` offsets into it and each wave's ``(first, end)``
    lanes. A unit's heavy child is its child with the longest chain of chunks below it (first such child on ties)."""
    producer = {row: unit for unit, row in enumerate(save_row) if row > 0}
    parent = [producer.get(row, -1) if row > 0 else -1 for row in initial_row]
    children: list[list[int]] = [[] for _ in initial_row]
    for unit, p in enumerate(parent):
        if p >= unit:
            raise ValueError(f"unit {unit} starts from the state of unit {p}, which does not run before it")
        if p >= 0:
            children[p].append(unit)
    chain = list(chunks)
    for unit in reversed(range(len(chain))):  # children after their parents in round order
        if children[unit]:
            chain[unit] += max(chain[c] for c in children[unit])
    heavy = [max(c, key=lambda child: chain[child]) if c else -1 for c in children]
    lanes, lane_of, wave_of = [], {}, []
    for unit, p in enumerate(parent):
        if p >= 0 and heavy[p] == unit:
            continue  # walked with its parent's lane
        lane, walk = [], unit
        while walk >= 0:
            lane.append(walk)
            lane_of[walk] = len(lanes)
            walk = heavy[walk]
        wave_of.append(0 if p < 0 else wave_of[lane_of[p]] + 1)
        lanes.append(lane)
    by_wave = sorted(range(len(lanes)), key=lambda lane: wave_of[lane])  # stable: round order within a wave
    order, lane_start, waves = [], [0], []
    for position, lane in enumerate(by_wave):
        order += lanes[lane]
        lane_start.append(len(order))
        if not waves or wave_of[lane] != wave_of[by_wave[waves[-1][0]]]:
            waves.append([position, position + 1])
        else:
            waves[-1][1] = position + 1
    return order, lane_start, [tuple(w) for w in waves]


def one_save_per_unit(batch) -> bool:
    """True when no unit of the round batch saves its final state under two keys (the serial pass keeps one bank
    row per unit)."""
    return all(torch.unique(slots).numel() == slots.numel() for slots in batch.save_slots)


def serial_units(plan, device, lanes: bool = False) -> SerialUnits:
    """The :class:`SerialUnits` of ``plan`` (cached on the plan per device), from its round batch: one lane in round
    order, or heavy-path ``lanes`` (:func:`lane_order`)."""
    from .round_batch import round_batch

    cache = plan.__dict__.setdefault("_serial_units", {})
    key = (str(device), lanes)
    if key in cache:
        return cache[key]
    batch = round_batch(plan, torch.device("cpu"))
    if not one_save_per_unit(batch):
        raise ValueError("a unit's final state is saved under two keys; the serial state pass keeps one row per "
                         "unit (use fla_backend.STATE_PASS = 'rounds')")
    cu = batch.cu_seqlens.long()
    lengths = cu[1:] - cu[:-1]
    counts = (lengths + plan.chunk_size - 1) // plan.chunk_size
    chunk = torch.nn.functional.pad(counts.cumsum(0), (1, 0))
    initial_row = torch.cat(batch.initial_ids) if batch.initial_ids else torch.zeros(0, dtype=torch.long)
    save_row = torch.full_like(initial_row, -1)
    offset = 0
    for initial_ids, save_ids, save_slots in zip(batch.initial_ids, batch.save_ids, batch.save_slots):
        save_row[offset + save_slots] = save_ids
        offset += initial_ids.numel()
    if lanes:
        order, lane_start, waves = lane_order(initial_row.tolist(), save_row.tolist(), counts.tolist())
    else:
        order, lane_start, waves = list(range(counts.numel())), [0, counts.numel()], [(0, 1)]
    order = torch.tensor(order, dtype=torch.long)
    units = SerialUnits(cu[:-1][order].to(device), cu[1:][order].to(device), chunk[:-1][order].to(device),
                        initial_row[order].to(device), save_row[order].to(device), int(chunk[-1]),
                        torch.tensor(lane_start, dtype=torch.long).to(device), waves)
    cache[key] = units
    return units


VALUE_BLOCK = 32
"""Value columns per program (capped at the value head size, at least 16): a program holds a ``[K, VALUE_BLOCK]``
fp32 state. Smaller blocks mean more programs (``HV * V / VALUE_BLOCK`` per lane: 128 at the 2B shapes, on 132
SMs) and fewer registers for the state, at the cost of loading each chunk's ``k`` and ``w`` once per block. 16, 32
or 64; the results are the same (columns of the state never mix)."""
_NUM_WARPS = 4
"""Warps per program; fixed (not a knob). Measured on the H200 (full-size tau, one 2B layer's node fwd+bwd,
2026-11-30): value block 32 at 4 warps 46.2 ms, 16 at 4 49.4, 64 at 4 55.7, 16 at 8 warps 54.4, and 32 at 8 warps
stopped with an illegal memory access (Triton 3.6; cause not found), so 8 warps are not offered."""

# pipelining stages per (kernel, device, 16-byte alignment of its tensors, value block) that fit in shared memory
# (Triton specialises on the alignment: a one-sequence forest's aligned variant pipelined deeper and asked for 246 KB
# of the H200's 227 KB at the default stages)
_STAGES: dict[tuple, int] = {}


def value_block(V: int) -> int:
    """The value block of a launch over value heads of ``V`` columns: :data:`VALUE_BLOCK`, capped at ``V`` rounded
    up to a power of two, at least 16."""
    if VALUE_BLOCK not in (16, 32, 64):
        raise ValueError(f"serial_state_pass.VALUE_BLOCK must be 16, 32 or 64, got {VALUE_BLOCK!r}")
    return min(VALUE_BLOCK, max(16, 1 << (V - 1).bit_length()))


def _launch(name: str, units: SerialUnits, tensors: tuple, keys, values, chunk_size: int, *scalars,
            reverse: bool = False, per_key: bool = False) -> None:
    """One launch per wave (in reverse for the backward), one program per (value head, block of value columns,
    lane of the wave); head counts and sizes from ``keys [1, T, H, K]`` and ``values [1, T, HV, V]``; ``per_key``:
    the gates are ``[1, T, HV, K]`` (KDA). A variant that needs more shared memory than the GPU has is compiled
    again with fewer pipelining stages."""
    import triton
    from triton.runtime.errors import OutOfResources

    from . import _serial_kernels

    _, _, H, K = keys.shape
    HV, V = values.shape[2], values.shape[3]
    BK = max(16, triton.next_power_of_2(K))
    BV = value_block(V)
    key = (name, keys.device.index, tuple(t.data_ptr() % 16 == 0 for t in tensors), BV, per_key)
    for first, end in reversed(units.waves) if reverse else units.waves:
        while True:
            stages = {} if key not in _STAGES else {"num_stages": _STAGES[key]}
            try:
                getattr(_serial_kernels, name)[(triton.cdiv(V, BV), HV, end - first)](
                    *tensors, units.bos, units.eos, units.chunk, units.initial_row, units.save_row, units.lane_start,
                    first, *scalars, H=H, HV=HV, K=K, V=V, BT=chunk_size, BK=BK, BV=BV, PER_KEY=per_key,
                    num_warps=_NUM_WARPS, **stages)
                break
            except OutOfResources:
                fewer = _STAGES.get(key, 3) - 1
                if fewer < 1:
                    raise
                _STAGES[key] = fewer


def tree_state_forward(units: SerialUnits, k, w, u, g, bank, chunk_size: int):
    """``k [1, T, H, K]``, ``w [1, T, HV, K]``, ``u [1, T, HV, V]``, ``g [1, T, HV]`` (fp32, log2 cumsum within
    chunks) and the fp32 ``bank [S, HV, K, V]`` (rows read by units, final states written in place) ->
    ``h [1, NT, HV, K, V]`` (state at every chunk start, ``k.dtype``) and ``v_new`` like ``u``. Per-channel gates
    (Kimi Delta Attention): ``g [1, T, HV, K]`` and ``k`` already decayed to its chunk's end (fla's ``kg``), as
    fla's state pass takes them with ``gk``."""
    h = k.new_empty(1, units.num_chunks, u.shape[2], k.shape[3], u.shape[3])
    v_new = torch.empty_like(u)
    _launch("forward_kernel", units, (k, w, u, g, h, v_new, bank), k, u, chunk_size, per_key=g.dim() == 4)
    return h, v_new


def tree_state_backward(units: SerialUnits, q, k, w, g, do, dv, d_bank, scale: float, chunk_size: int):
    """Backward of :func:`tree_state_forward`'s state pass: ``do``, ``dv [1, T, HV, V]`` (the output stage's local
    value gradient) and ``d_bank`` (fp32, holding the requested states' gradients; each unit's initial-state
    gradient is added to its row in place) -> ``dh [1, NT, HV, K, V]`` (``q.dtype``) and ``dv2`` like ``dv``.
    Per-channel gates as for the forward: ``g [1, T, HV, K]``, ``q`` and ``k`` gated as fla's ``qg`` / ``kg``."""
    dh = q.new_empty(1, units.num_chunks, do.shape[2], q.shape[3], do.shape[3])
    dv2 = torch.empty_like(dv)
    _launch("backward_kernel", units, (q, k, w, g, do, dv, dh, dv2, d_bank), q, do, chunk_size, scale,
            reverse=True, per_key=g.dim() == 4)
    return dh, dv2
