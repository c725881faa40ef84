"""The ``"fla"`` backend for per-channel gates (Kimi Delta Attention, CUDA only).

The plan must be built with ``final_states_only=True`` (fla returns each unit's final state only; runs are cut at
the chunk boundaries their children restart from), as for the Gated DeltaNet nodes of :mod:`.fla_backend`.

With :data:`BATCH_ROUNDS` (the default), :class:`_TreeKdaBatched` is one autograd node for all rounds, as the Gated
DeltaNet's round-batched node: only fla's state pass (forward) and state-gradient pass (backward) depend on a unit's
initial state, so every other stage of ``chunk_kda`` (gate cumsum, intra-chunk solve, output, dA / dv, the fused WY
and dq / dk / dg backward, the intra-chunk backward) runs ONCE over the executed tokens of every round, and per round
only the state kernels run on the round's slice, on the host-built chunk grid, or, where
:func:`~.fla_backend.state_pass_for` picks it (``fla_backend.STATE_PASS``, as for Gated DeltaNet), every unit's in
one launch per direction (:mod:`.serial_state_pass` with per-channel gates, which also leaves the rounds' chunk
states and new values in one buffer instead of concatenating them). ``BATCH_ROUNDS = False``: fla's
public ``chunk_kda`` once per round, each its own autograd node, states handed between rounds through autograd
(:func:`per_round`). Both are checked through fla's Triton kernels on the CPU (Triton's interpreter;
``scripts/check_fla_nodes_on_cpu.py``, ``check_round_node``, ``check_model_backends``) against the torch backend,
and against each other (the same to rounding: a replayed token's gradient terms are summed in another order).
"""
from __future__ import annotations

import functools

import torch

from .. import kept
from . import fla_backend
from .plan import CONTEXT_STATE, GatedDeltaPlan
from .round_batch import round_batch

__all__ = ["import_fla_op", "per_round", "tree_kda_fla"]

BATCH_ROUNDS = True
"""True: the round-batched node (:class:`_TreeKdaBatched`); False: fla's public ``chunk_kda`` once per round."""


def import_fla_op(module: str, name: str, what: str):
    """``module.name`` from fla, or an ImportError naming ``what`` needs it and how to install fla."""
    try:
        return getattr(__import__(module, fromlist=[name]), name)
    except ImportError as error:  # pragma: no cover - depends on the machine
        raise ImportError(f"{what} on the 'fla' backend needs flash-linear-attention >= 0.6 and triton on a CUDA "
                          "machine: pip install 'flash-linear-attention>=0.6,<0.7'") from error


def tree_kda_fla(q, k, v, g, beta, plan: GatedDeltaPlan, *, scale: float, use_qk_l2norm_in_kernel: bool,
                 initial_state: torch.Tensor | None = None, output_requested_states: bool = False,
                 context: tuple | None = None):
    """Same contract as :func:`~.ops.tree_gated_delta_rule` with ``g [U, HV, K]``: the ``U`` packed rows, and
    ``context`` (or None) the plan's context rows ``(q, k, v, g, beta)``, read in place by the round-batched node
    (concatenated below the packed rows otherwise); ``initial_state``: the state under :data:`CONTEXT_STATE`."""
    fla_backend._check(q, plan)
    if BATCH_ROUNDS:
        result = _TreeKdaBatched.apply(q, k, v, g, beta, initial_state, plan, scale, use_qk_l2norm_in_kernel,
                                       *(context or ()))
        return fla_backend.node_result(result, plan, output_requested_states)
    if context is not None:
        q, k, v, g, beta = (torch.cat([x, c.to(x.dtype)]) for x, c in zip((q, k, v, g, beta), context))
    chunk_kda = import_fla_op("fla.ops.kda", "chunk_kda", "per-channel gates (Kimi Delta Attention)")

    def call(round_, inputs, initial):
        q_, k_, v_, g_, beta_ = inputs
        return chunk_kda(q_, k_, v_, g_.float(), beta_, scale=scale, initial_state=initial, output_final_state=True,
                         use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=round_.cu_seqlens.long())

    return per_round(call, (q, k, v, g, beta), plan, initial_state, output_requested_states)


def per_round(call, inputs: tuple, plan: GatedDeltaPlan, initial_state: torch.Tensor | None,
              output_requested_states: bool):
    """Run ``call(round, inputs of the round's tokens [1, T, ...] each, initial states [n, HV, K, V]) -> (o [1, T,
    HV, V], final states [n, HV, K, V])`` once per round of ``plan`` over ``inputs = (q, k, v, ...)`` rows (packed,
    then context), handing each saved final state to the units that start from it (through autograd); returns
    ``o [U, HV, V]`` and, with ``output_requested_states``, the plan's requested states."""
    q, k, v = inputs[:3]
    U, HV, V = plan.num_tokens, v.shape[1], v.shape[2]
    zero = q.new_zeros(HV, k.shape[-1], V, dtype=torch.float32)
    states: dict = {} if initial_state is None else {CONTEXT_STATE: initial_state.float()}
    out_tokens, out_values = [], []
    for round_ in plan.rounds:
        round_ = fla_backend._on(round_, q.device)
        index = round_.token_index
        initial = torch.stack([zero if key is None else states[key] for key in round_.initial_state])
        o, final = call(round_, [x[index].unsqueeze(0) for x in inputs], initial)
        for slot, _, key in round_.saved_states:
            states[key] = final[slot]
        out_tokens.append(round_.output_token)
        out_values.append(o[0, round_.output_position])
    out = v.new_zeros(U, HV, V).index_copy(0, torch.cat(out_tokens), torch.cat(out_values).to(v.dtype))
    if not output_requested_states:
        return out
    return out, [None if key is None else states[key] for key in plan.requested_states]


def _kda_stages() -> dict:
    """fla 0.6's stages of ``chunk_kda`` (the ones its own forward and backward call), with the state passes of
    :func:`~.fla_backend._import_fla_stages`."""
    try:
        from fla.ops.gla.chunk import chunk_gla_fwd_o_gk
        from fla.ops.kda.chunk_bwd import chunk_kda_bwd_dAv, chunk_kda_bwd_wy_dqkg_fused
        from fla.ops.kda.chunk_intra import chunk_kda_bwd_intra, chunk_kda_fwd_intra
        from fla.ops.kda.wy_fast import recompute_w_u_fwd
    except ImportError as error:  # pragma: no cover - depends on the machine
        raise ImportError("per-channel gates (Kimi Delta Attention) on the 'fla' backend need fla 0.6's chunk_kda "
                          "stages: pip install 'flash-linear-attention>=0.6,<0.7'; or set fla_kda.BATCH_ROUNDS = "
                          "False") from error
    return dict(fla_backend._import_fla_stages(), fwd_intra_kda=chunk_kda_fwd_intra, fwd_o_gk=chunk_gla_fwd_o_gk,
                recompute_w_u_kda=recompute_w_u_fwd, bwd_dav=chunk_kda_bwd_dAv, bwd_wy_dqkg=chunk_kda_bwd_wy_dqkg_fused,
                bwd_intra=chunk_kda_bwd_intra)


def _forward_body(qe, kg, w, u, g_cumsum, Aqk, initial_state, *, plan: GatedDeltaPlan, scale: float, state_pass: str,
                  shape: tuple, dtype: torch.dtype) -> tuple:
    """The round-batched node's state pass and output stage from its intra-chunk stage's results (the executed
    layout's): ``o [U, HV, V]`` in ``dtype`` and the requested states ``[R, HV, K, V]`` (fp32); ``shape``: ``(HV, K,
    V)``."""
    st = _kda_stages()
    batch = round_batch(plan, qe.device)
    grid = dict(cu_seqlens=batch.cu_seqlens, chunk_size=plan.chunk_size, chunk_indices=batch.chunk_indices)
    bank = fla_backend._state_bank(batch, initial_state, *shape, qe.device)
    h, v_new = fla_backend.states_forward(st, batch, plan, state_pass, kg, w, u, g_cumsum, bank, [], gate="gk")
    o = st["fwd_o_gk"](q=qe, v=v_new, g=g_cumsum, A=Aqk, h=h, scale=scale, **grid)
    return batch.own_outputs(o[0]).to(dtype), bank[batch.requested_ids]


class _TreeKdaBatched(torch.autograd.Function):
    """All rounds of the plan as one autograd node; fp32 states stay inside it. ``q, k [U, H, K]``, ``v [U, HV, V]``,
    ``g [U, HV, K]``, ``beta [U, HV]``: the ``U`` packed tokens; ``*context``: none, or the plan's context rows as the
    same five tensors (a planner piece's replay rows, gathered into the executed layout in place). Returns ``o [U, HV,
    V]`` and the plan's requested states stacked ``[R, HV, K, V]`` (zeros where a request is None). The backward
    recomputes w / u and the chunk states, as fla's own backward does."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, plan, scale, use_qk_l2norm_in_kernel, *context):
        st, l2norm_fwd = _kda_stages(), fla_backend._import_fla()[3]
        batch = round_batch(plan, q.device)
        HV, K, V = v.shape[1], k.shape[2], v.shape[2]
        # a piece's context rows (or Nones), read in place
        q, k, q_rstd, k_rstd, (cq, ck, cv, cg, cb), cq_rstd, ck_rstd = fla_backend.normed_inputs(
            l2norm_fwd, use_qk_l2norm_in_kernel, q, k, context)
        grid = dict(cu_seqlens=batch.cu_seqlens, chunk_size=plan.chunk_size, chunk_indices=batch.chunk_indices)
        qe, ke, ve, be = (batch.executed(x, c) for x, c in ((q, cq), (k, ck), (v, cv), (beta, cb)))
        g_cumsum = st["cumsum"](batch.executed(g, cg).float(), scale=st["rcp_ln2"], **grid)
        w, u, _, kg, Aqk, Akk = st["fwd_intra_kda"](q=qe, k=ke, v=ve, gk=g_cumsum, beta=be, scale=scale, **grid)
        del ke, ve, be
        state_pass = fla_backend.state_pass_for(plan)
        # the state pass and the output stage: kept from the forward where checkpointing keeps mixer outputs
        out, requested = kept.run(functools.partial(_forward_body, plan=plan, scale=scale, state_pass=state_pass,
                                                    shape=(HV, K, V), dtype=v.dtype),
                                  (qe, kg, w, u, g_cumsum, Aqk, initial_state))
        saved_context = (cq, ck, cv, cb, cq_rstd, ck_rstd) if context else ()
        ctx.save_for_backward(q, k, v, beta, q_rstd, k_rstd, g_cumsum, Aqk, Akk, *saved_context,
                              *(() if initial_state is None else (initial_state,)))
        ctx.plan, ctx.scale, ctx.use_qk_l2norm_in_kernel = plan, scale, use_qk_l2norm_in_kernel
        ctx.g_dtype, ctx.initial_dtype = g.dtype, None if initial_state is None else initial_state.dtype
        ctx.context_g_dtype, ctx.state_pass = cg.dtype if context else None, state_pass
        return out, requested

    @staticmethod
    def backward(ctx, d_out, d_requested):
        st, l2norm_bwd = _kda_stages(), fla_backend._import_fla()[4]
        q, k, v, beta, q_rstd, k_rstd, g_cumsum, Aqk, Akk, *rest = ctx.saved_tensors
        has_context = ctx.context_g_dtype is not None
        saved_context, initial = (rest[:6], rest[6:]) if has_context else ((), rest)
        cq, ck, cv, cb = saved_context[:4] if has_context else (None,) * 4
        plan, scale = ctx.plan, ctx.scale
        batch = round_batch(plan, q.device)
        U, HV, V = v.shape
        rows = U + (cv.shape[0] if has_context else 0)
        H, K = k.shape[1], k.shape[2]
        grid = dict(cu_seqlens=batch.cu_seqlens, chunk_size=plan.chunk_size, chunk_indices=batch.chunk_indices)
        qe, ke, ve, be = (batch.executed(x, c) for x, c in ((q, cq), (k, ck), (v, cv), (beta, cb)))
        w, u, qg, kg = st["recompute_w_u_kda"](q=qe, k=ke, v=ve, beta=be, A=Akk, gk=g_cumsum,
                                               cu_seqlens=batch.cu_seqlens, chunk_indices=batch.chunk_indices)
        bank = fla_backend._state_bank(batch, initial[0] if initial else None, HV, K, V, q.device)
        initials: list = []
        h, v_new = fla_backend.states_forward(st, batch, plan, ctx.state_pass, kg, w, u, g_cumsum, bank, initials,
                                              gate="gk")
        do = batch.executed_grad(d_out)
        dAqk, dv = st["bwd_dav"](q=qe, k=ke, v=v_new, do=do, A=Aqk, scale=scale, **grid)
        d_bank = batch.bank_grad(bank, d_requested)
        dh, dv = fla_backend.states_backward(st, batch, plan, ctx.state_pass, qg, kg, w, g_cumsum, do, dv, initials,
                                             d_bank, scale, gate="gk")
        dq, dk, dv, db, dg, dAkk = st["bwd_wy_dqkg"](q=qe, k=ke, v=ve, v_new=v_new, g=g_cumsum, beta=be, A=Akk, h=h,
                                                     do=do, dh=dh, dv=dv, scale=scale, **grid)
        dq, dk, db, dg = st["bwd_intra"](q=qe, k=ke, g=g_cumsum, beta=be, dAqk=dAqk, dAkk=dAkk, dq=dq, dk=dk, db=db,
                                         dg=dg, **grid)
        if HV > H:  # grouped value heads: the per-value-head key gradients summed over each group
            dq, dk = (x.view(*x.shape[:2], H, HV // H, K).sum(3) for x in (dq, dk))
        dg = st["cumsum"](dg, reverse=True, **grid)
        grads = tuple(batch.sum_by_token(grad[0].float(), rows) for grad in (dq, dk, dv, dg, db))
        d_state = {} if batch.context_id is None else {CONTEXT_STATE: d_bank[batch.context_id]}
        grads = fla_backend.node_input_grads(ctx.use_qk_l2norm_in_kernel, ctx.g_dtype, ctx.initial_dtype,
                                             ctx.context_g_dtype, l2norm_bwd, (q, k, v, beta, q_rstd, k_rstd),
                                             saved_context, grads, d_state)
        return (*grads[:6], None, None, None, *grads[6:])
