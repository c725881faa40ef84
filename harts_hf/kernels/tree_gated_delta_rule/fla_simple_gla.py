"""The ``"fla"`` backend without the delta rule (gated linear attention: Mamba-2's scan, CUDA only), on the plan's
own chunk grid (fla's ``chunk_size``: Mamba-2's 128 where the mixer says so).

``beta`` scales the values (``S = exp(g) S + k (beta v)^T``). Keys and queries keep their head groups (Mamba-2's
``n_groups``) where fla's stages take them (the output, ``dq / dk / dg`` and ``dv`` stages read head ``h // (HV // H)``
and sum ``dq / dk`` over each group themselves); only fla's state kernels take one key head per value head, so only
their inputs (keys in the state pass, queries in the state-gradient pass) are repeated, at the executed size. On an
H100, repeating and gathering both at the 64 value heads of the Nemotron-H-shaped preset took about 0.29 of its 3.72 s
of full-size ``tau`` (2026-12-05). The plan must be built with ``final_states_only=True``, as for
:mod:`.fla_backend` and :mod:`.fla_kda`.

With :data:`BATCH_ROUNDS` (the default), :class:`_TreeSimpleGlaBatched` is one autograd node for all rounds: only the
state pass (forward) and the state-gradient pass (backward) depend on a unit's initial state, so fla's other stages of
``chunk_simple_gla`` (gate cumsum, output, dq / dk / dg, dv) run ONCE over the executed tokens of every round, laid
out round after round (:func:`~.round_batch.round_batch`), and per round only fla's state kernel runs on that
round's slice, on a host-built chunk grid: no device-to-host read, three launches per round. The state pass and the
output stage run as one body (:func:`_forward_body`), which checkpointing keeps for the backward's rerun where mixer
outputs are kept (:mod:`harts_hf.kernels.kept`). Every kernel works chunk by chunk within a unit, so the arithmetic
is the per-round function's. ``BATCH_ROUNDS = False``: fla's public
``chunk_simple_gla`` once per round, states handed over through autograd (:func:`~.fla_kda.per_round`; on the
H200 full-size ``tau`` reached 0.70 of its FLOP ratio that way, BENCHMARKS.md). Both are checked through fla's
Triton kernels on the CPU (Triton's interpreter; ``scripts/check_fla_nodes_on_cpu.py``, ``check_round_node`` and
``check_mamba2_model``) against the torch backend.
"""

from __future__ import annotations

import functools

import torch

from .. import kept
from . import fla_backend
from .fla_kda import import_fla_op, per_round
from .plan import GatedDeltaPlan
from .round_batch import round_batch

__all__ = ["tree_simple_gla_fla"]

BATCH_ROUNDS = True
"""True: the round-batched node (:class:`_TreeSimpleGlaBatched`); False: fla's public function once per round."""


def tree_simple_gla_fla(q, k, v, g, beta, plan: GatedDeltaPlan, *, scale: float,
                        initial_state: torch.Tensor | None = None, output_requested_states: bool = False,
                        context: tuple | None = None):
    """Same contract as :func:`~.ops.tree_gated_delta_rule` with ``delta=False`` and ``g [U, HV]``: the ``U`` packed
    rows, and ``context`` (or None) the plan's context rows ``(q, k, v, g, beta)``, read in place by the round-batched
    node (concatenated below the packed rows otherwise); ``initial_state``: the state under :data:`CONTEXT_STATE`."""
    fla_backend._check(q, plan)
    v = v * beta.unsqueeze(-1).to(v.dtype)
    if context is not None:
        cq, ck, cv, cg, cbeta = context
        context = (cq, ck, cv * cbeta.unsqueeze(-1).to(cv.dtype), cg)
    if BATCH_ROUNDS:
        result = _TreeSimpleGlaBatched.apply(q, k, v, g, initial_state, plan, scale, *(context or ()))
        return fla_backend.node_result(result, plan, output_requested_states)
    if context is not None:
        q, k, v, g = (torch.cat([x, c.to(x.dtype)]) for x, c in zip((q, k, v, g), context))
    q, k = (_per_value_head(x, v.shape[1] // k.shape[1], dim=1) for x in (q, k))  # fla's public function wants them
    chunk_simple_gla = import_fla_op("fla.ops.simple_gla", "chunk_simple_gla", "gated linear attention (Mamba-2)")

    def call(round_, inputs, initial):
        q_, k_, v_, g_ = inputs
        return chunk_simple_gla(q_, k_, v_, g=g_.float(), scale=scale, initial_state=initial, output_final_state=True,
                                cu_seqlens=round_.cu_seqlens.long(), chunk_size=plan.chunk_size)

    return per_round(call, (q, k, v, g), plan, initial_state, output_requested_states)


def _stages() -> dict:
    """fla 0.6's stages of ``chunk_simple_gla`` (the ones its own forward and backward call; the state kernels
    themselves, so that the chunk offsets come from the host)."""
    try:
        import triton
        from fla.ops.common.chunk_h import chunk_bwd_kernel_dh, chunk_fwd_kernel_h
        from fla.ops.common.chunk_o import chunk_bwd_dqkwg, chunk_bwd_dv, chunk_fwd_o
        from fla.ops.utils import chunk_local_cumsum
        from fla.ops.utils.constant import RCP_LN2
    except ImportError as error:  # pragma: no cover - depends on the machine
        raise ImportError("gated linear attention (Mamba-2) on the 'fla' backend needs fla 0.6's chunk stages "
                          "(fla.ops.common.chunk_h, chunk_o): pip install 'flash-linear-attention>=0.6,<0.7'; or "
                          "set fla_simple_gla.BATCH_ROUNDS = False") from error
    return dict(cdiv=triton.cdiv, fwd_h=chunk_fwd_kernel_h, bwd_dh=chunk_bwd_kernel_dh, fwd_o=chunk_fwd_o,
                bwd_dqkwg=chunk_bwd_dqkwg, bwd_dv=chunk_bwd_dv, cumsum=chunk_local_cumsum, rcp_ln2=RCP_LN2)


def _per_value_head(x: torch.Tensor, groups: int, dim: int = 2) -> torch.Tensor:
    """Query or key heads repeated to one per value head (``groups`` value heads per key head, consecutive)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=dim)


_NO_GATES = dict(g_gamma=None, gk=None, gv=None)
_FLAGS = dict(USE_G=True, USE_G_GAMMA=False, USE_GK=False, USE_GV=False, STATE_V_FIRST=False)


def _state_pass(st, batch, chunk_size: int, k, v, g, bank, dtype) -> torch.Tensor:
    """fla's state kernel round by round over ``k, v, g [1, E, H, ...]`` (all rounds' executed tokens): each
    round's units start from their rows of the fp32 state ``bank``, and the final states the plan saves are
    written back to it. Returns the chunk states ``h [1, NT, H, K, V]`` (``dtype``) of all rounds."""
    H, K, V = k.shape[2], k.shape[3], v.shape[3]
    h = k.new_empty(1, batch.chunk_indices.shape[0], H, K, V, dtype=dtype)
    for r, (t, c) in enumerate(zip(batch.tokens, batch.chunks)):
        units = batch.round_cu[r].numel() - 1
        final = k.new_empty(units, H, K, V, dtype=torch.float32)
        st["fwd_h"][lambda meta, n=units: (st["cdiv"](K, meta["BK"]) * st["cdiv"](V, meta["BV"]) * n * H,)](
            k=k[:, t], v=v[:, t], h=h[:, c], g=g[:, t], **_NO_GATES, h0=bank[batch.initial_ids[r]], ht=final,
            cu_seqlens=batch.round_cu[r], split_offsets=batch.round_chunk_offsets[r], T=t.stop - t.start, H=H, K=K,
            V=V, BT=chunk_size, BS=chunk_size, **_FLAGS)
        bank.index_copy_(0, batch.save_ids[r], final[batch.save_slots[r]])
    return h


def _state_gradient_pass(st, batch, chunk_size: int, q, g, do, d_bank, scale: float, V: int) -> torch.Tensor:
    """fla's state-gradient kernel round by round, in reverse: a unit that starts from a state runs in a later
    round than the one saving it, so a row of ``d_bank`` is complete before the unit that saved it reads it.
    Returns the fp32 chunk-state gradients ``dh [1, NT, H, K, V]`` of all rounds."""
    H, K = q.shape[2], q.shape[3]
    dh = q.new_empty(1, batch.chunk_indices.shape[0], H, K, V, dtype=torch.float32)
    for r in reversed(range(len(batch.tokens))):
        t, c = batch.tokens[r], batch.chunks[r]
        units = batch.round_cu[r].numel() - 1
        dht = d_bank.new_zeros(units, H, K, V).index_copy_(0, batch.save_slots[r], d_bank[batch.save_ids[r]])
        dh0 = torch.empty_like(dht)
        st["bwd_dh"][lambda meta, n=units: (st["cdiv"](K, meta["BK"]) * st["cdiv"](V, meta["BV"]) * n * H,)](
            q=q[:, t], g=g[:, t], **_NO_GATES, do=do[:, t], dh=dh[:, c], dht=dht, dh0=dh0,
            cu_seqlens=batch.round_cu[r], split_offsets=batch.round_chunk_offsets[r], scale=scale, T=t.stop - t.start,
            HQ=H, H=H, K=K, V=V, BT=chunk_size, BS=chunk_size, NG=1, **_FLAGS)
        d_bank.index_add_(0, batch.initial_ids[r], dh0)
    return dh


def _forward_body(q, k, v, g_cumsum, initial_state, cq=None, ck=None, cv=None, *, plan: GatedDeltaPlan,
                  scale: float) -> tuple:
    """The round-batched node's forward from ``g_cumsum [1, E, HV]`` (fp32, the executed layout's): ``o [U, HV, V]``
    (``v``'s dtype) and the requested states ``[R, HV, K, V]`` (fp32). ``cq, ck, cv``: a piece's context rows."""
    st = _stages()
    batch = round_batch(plan, q.device)
    HV, K, V = v.shape[1], k.shape[2], v.shape[2]
    grid = dict(cu_seqlens=batch.cu_seqlens, chunk_size=plan.chunk_size, chunk_indices=batch.chunk_indices)
    qe, ke, ve = (batch.executed(x, c) for x, c in ((q, cq), (k, ck), (v, cv)))
    bank = fla_backend._state_bank(batch, initial_state, HV, K, V, q.device)
    h = _state_pass(st, batch, plan.chunk_size, _per_value_head(ke, HV // k.shape[1]), ve, g_cumsum, bank, k.dtype)
    o = st["fwd_o"](q=qe, k=ke, v=ve, g=g_cumsum, g_gamma=None, h=h, scale=scale, **grid)
    return batch.own_outputs(o[0]).to(v.dtype), bank[batch.requested_ids]


class _TreeSimpleGlaBatched(torch.autograd.Function):
    """All rounds of the plan as one autograd node; fp32 states stay inside it. ``q, k [U, H, K]`` (H divides HV),
    ``v [U, HV, V]`` (beta applied), ``g [U, HV]``: the ``U`` packed tokens; ``*context``: none, or the plan's context
    rows as the same four tensors (read in place). Returns ``o [U, HV, V]`` and the plan's requested states stacked
    ``[R, HV, K, V]`` (zeros where a request is None). The backward recomputes the chunk states in fp32 (as fla's own
    backward does), the hand-offs included."""

    @staticmethod
    def forward(ctx, q, k, v, g, initial_state, plan, scale, *context):
        st = _stages()
        batch = round_batch(plan, q.device)
        grid = dict(cu_seqlens=batch.cu_seqlens, chunk_size=plan.chunk_size, chunk_indices=batch.chunk_indices)
        g_cumsum = st["cumsum"](batch.executed(g, context[3] if context else None).float(), scale=st["rcp_ln2"],
                                **grid)
        # the state pass and the output stage: kept from the forward where checkpointing keeps mixer outputs
        out, requested = kept.run(functools.partial(_forward_body, plan=plan, scale=scale),
                                  (q, k, v, g_cumsum, initial_state, *context[:3]))
        ctx.save_for_backward(q, k, v, g_cumsum, *context, *(() if initial_state is None else (initial_state,)))
        ctx.plan, ctx.scale, ctx.g_dtype, ctx.num_context = plan, scale, g.dtype, len(context)
        ctx.initial_dtype = None if initial_state is None else initial_state.dtype
        return out, requested

    @staticmethod
    def backward(ctx, d_out, d_requested):
        st = _stages()
        q, k, v, g_cumsum, *rest = ctx.saved_tensors
        context, initial = rest[:ctx.num_context], rest[ctx.num_context:]
        cq, ck, cv, cg = context or (None,) * 4
        plan, scale = ctx.plan, ctx.scale
        batch = round_batch(plan, q.device)
        U, HV, V = v.shape
        rows = U + (cv.shape[0] if context else 0)
        K = k.shape[2]
        grid = dict(cu_seqlens=batch.cu_seqlens, chunk_size=plan.chunk_size, chunk_indices=batch.chunk_indices)
        qe, ke, ve = (batch.executed(x, c) for x, c in ((q, cq), (k, ck), (v, cv)))
        groups = HV // k.shape[1]
        bank = fla_backend._state_bank(batch, initial[0] if initial else None, HV, K, V, q.device)
        h = _state_pass(st, batch, plan.chunk_size, _per_value_head(ke, groups), ve, g_cumsum, bank, torch.float32)
        do = batch.executed_grad(d_out)
        d_bank = batch.bank_grad(bank, d_requested)
        dh = _state_gradient_pass(st, batch, plan.chunk_size, _per_value_head(qe, groups), g_cumsum, do, d_bank, scale,
                                  V)
        # q, k, v and do in the states' fp32 for this stage: with half-precision inputs (``mamba2.SCAN_INPUTS``),
        # fla 0.6 on Hopper under Triton < 3.7.1 has no kernel for it (its Triton one raises, #640; its TileLang one
        # wants h in q's dtype); the stage then computes as under the fp32 setting (its Triton kernel elsewhere would
        # round h and dh to the half dtype instead)
        dq, dk, _, dg = st["bwd_dqkwg"](**{name: x.to(h.dtype) for name, x in (("q", qe), ("k", ke), ("v", ve),
                                                                                 ("do", do))},
                                        g=g_cumsum, g_gamma=None, h=h, dh=dh, scale=scale, **grid)
        dv = st["bwd_dv"](q=qe, k=ke, g=g_cumsum, g_gamma=None, do=do, dh=dh, scale=scale, **grid)
        dg = st["cumsum"](dg, reverse=True, **grid)
        grads = [dq, dk, dv, dg]  # each summed by token in its parameter's dtype, the executed-size one freed
        del dq, dk, dv, dg, h, dh, do, qe, ke, ve
        for i, dtype in enumerate((q.dtype, k.dtype, v.dtype, ctx.g_dtype)):
            grads[i] = batch.sum_by_token(grads[i][0], rows, dtype)
        d_initial = None
        if ctx.initial_dtype is not None and batch.context_id is not None:
            d_initial = d_bank[batch.context_id].to(ctx.initial_dtype)
        own = [grad[:U] for grad in grads]  # the packed rows' and the context rows' parts: views of one buffer each
        context_grads = [grad[U:].to(c.dtype) for grad, c in zip(grads, context)]
        return (*own, d_initial, None, None, *context_grads)
