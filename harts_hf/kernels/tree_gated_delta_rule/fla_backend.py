"""The ``"fla"`` backend: one fla varlen chunked gated-delta-rule launch sequence per round (CUDA only).

The plan must be built with ``final_states_only=True``: fla returns only each sequence's final state, so
runs are cut at the chunk boundaries their children restart from.

:func:`tree_gated_delta_rule_fla` is one autograd node for all rounds. It calls fla's forward and backward
building blocks (``chunk_gated_delta_rule_fwd`` / ``_bwd``, which dispatch to the same kernels fla's own
``chunk_gated_delta_rule`` uses, including its Hopper-safe backends) with the plan's host-built chunk grid:
the L2 norms run once over the unique tokens, no per-round autograd bookkeeping, no contiguity copies and
no device-to-host reads. The backward walks the rounds in reverse and hands each unit's initial-state
gradient to the unit whose final state it was. :func:`tree_gated_delta_rule_fla_autograd` is the plain
version (fla's public function once per round, autograd in between), kept as a check for the fused one.
"""

from __future__ import annotations

import torch

from .plan import CONTEXT_STATE, GatedDeltaPlan


def _import_fla():
    try:
        from fla.modules.norm.l2norm import l2norm_bwd, l2norm_fwd
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_bwd, chunk_gated_delta_rule_fwd
    except ImportError as error:  # pragma: no cover - depends on the machine
        raise ImportError("the 'fla' backend needs flash-linear-attention >= 0.6 and triton on a CUDA machine: "
                          "pip install 'flash-linear-attention>=0.6,<0.7'") from error
    return chunk_gated_delta_rule, chunk_gated_delta_rule_fwd, chunk_gated_delta_rule_bwd, l2norm_fwd, l2norm_bwd


def _check(q, plan: GatedDeltaPlan) -> None:
    if not q.is_cuda:
        raise ValueError("tree_gated_delta_rule_fla needs CUDA tensors; CPU tensors take the torch backend")
    if any(saved[1] is not None for round_ in plan.rounds for saved in round_.saved_states):
        raise ValueError("the fla backend needs a plan built with final_states_only=True "
                         "(build_gated_delta_plan(packed, final_states_only=True))")


def _on(round_, device):
    return round_ if round_.token_index.device == device else round_.to(device)


class _TreeGatedDeltaRuleFla(torch.autograd.Function):
    """All rounds of the plan as one autograd node; fp32 states stay inside it.

    Rows are the ``U`` packed tokens then the plan's context rows; ``initial_state`` (or None) is the state under
    :data:`CONTEXT_STATE`. Returns ``o [U, HV, V]`` and the plan's requested states stacked ``[R, HV, K, V]``
    (zeros where a request is None).
    """

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, plan, scale, use_qk_l2norm_in_kernel):
        _, fwd, _, l2norm_fwd, _ = _import_fla()
        U, HV, V = plan.num_tokens, v.shape[1], v.shape[2]
        K = k.shape[-1]
        q_rstd = k_rstd = None
        if use_qk_l2norm_in_kernel:
            q, q_rstd = l2norm_fwd(q.contiguous())
            k, k_rstd = l2norm_fwd(k.contiguous())
        g_dtype, g = g.dtype, g.float()
        rounds = [_on(round_, q.device) for round_ in plan.rounds]
        zero = q.new_zeros(HV, K, V, dtype=torch.float32)
        states: dict = {} if initial_state is None else {CONTEXT_STATE: initial_state.float()}
        out = v.new_zeros(U, HV, V)
        per_round = []
        for round_ in rounds:
            index = round_.token_index
            initial = torch.stack([zero if key is None else states[key] for key in round_.initial_state])
            g_cumsum, o, A, final, _, _ = fwd(
                q[index].unsqueeze(0), k[index].unsqueeze(0), v[index].unsqueeze(0), g[index].unsqueeze(0),
                beta[index].unsqueeze(0), scale, initial, True, cu_seqlens=round_.cu_seqlens.long(),
                chunk_indices=round_.chunk_indices)
            for slot, _, key in round_.saved_states:
                states[key] = final[slot]
            out[round_.output_token] = o[0, round_.output_position].to(v.dtype)
            per_round += [g_cumsum, A, initial]
        requested = torch.stack([zero if key is None else states[key] for key in plan.requested_states]) \
            if plan.requested_states else zero.new_zeros(0, HV, K, V)
        ctx.save_for_backward(q, k, v, beta, q_rstd, k_rstd, *per_round)
        ctx.rounds, ctx.scale, ctx.use_qk_l2norm_in_kernel = rounds, scale, use_qk_l2norm_in_kernel
        ctx.g_dtype, ctx.requested_keys = g_dtype, list(plan.requested_states)
        ctx.initial_dtype = None if initial_state is None else initial_state.dtype
        return out, requested

    @staticmethod
    def backward(ctx, d_out, d_requested):
        _, _, bwd, _, l2norm_bwd = _import_fla()
        q, k, v, beta, q_rstd, k_rstd, *per_round = ctx.saved_tensors
        rows, HV, V = v.shape
        d_out = d_out.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk, dv = torch.zeros_like(dq), torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        dg = torch.zeros(rows, HV, dtype=torch.float32, device=v.device)
        dbeta = torch.zeros_like(dg)
        d_state: dict = {}  # state key -> gradient flowing into it (from the units that started from it)
        for key, grad in zip(ctx.requested_keys, d_requested if d_requested is not None else ()):
            if key is not None:
                d_state[key] = d_state[key] + grad.float() if key in d_state else grad.float()
        for r in reversed(range(len(ctx.rounds))):
            round_ = ctx.rounds[r]
            g_cumsum, A, initial = per_round[3 * r: 3 * r + 3]
            index = round_.token_index
            do = d_out.new_zeros(index.shape[0], HV, V)
            do[round_.output_position] = d_out[round_.output_token]
            dht = torch.zeros_like(initial)
            for slot, _, key in round_.saved_states:
                if key in d_state:
                    dht[slot] += d_state.pop(key)
            dq_r, dk_r, dv_r, db_r, dg_r, dh0, _, _ = bwd(
                q[index].unsqueeze(0), k[index].unsqueeze(0), v[index].unsqueeze(0), g_cumsum, beta[index].unsqueeze(0),
                A, ctx.scale, initial, do.unsqueeze(0), dht, cu_seqlens=round_.cu_seqlens.long(),
                chunk_indices=round_.chunk_indices)
            dq.index_add_(0, index, dq_r[0].float())
            dk.index_add_(0, index, dk_r[0].float())
            dv.index_add_(0, index, dv_r[0].float())
            dg.index_add_(0, index, dg_r[0].float())
            dbeta.index_add_(0, index, db_r[0].float())
            for slot, key in enumerate(round_.initial_state):
                if key is not None:
                    d_state[key] = d_state[key] + dh0[slot] if key in d_state else dh0[slot]
        if ctx.use_qk_l2norm_in_kernel:
            dq = l2norm_bwd(q, q_rstd, dq)
            dk = l2norm_bwd(k, k_rstd, dk)
        d_initial = None
        if ctx.initial_dtype is not None and CONTEXT_STATE in d_state:
            d_initial = d_state.pop(CONTEXT_STATE).to(ctx.initial_dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(ctx.g_dtype), dbeta.to(beta.dtype), \
            d_initial, None, None, None


def tree_gated_delta_rule_fla(q, k, v, g, beta, plan: GatedDeltaPlan, *, scale: float,
                              use_qk_l2norm_in_kernel: bool, initial_state: torch.Tensor | None = None,
                              output_requested_states: bool = False):
    """Same contract as :func:`tree_gated_delta_rule` (``[U + R, H, D]`` rows on CUDA: packed, then the plan's
    context rows; ``initial_state`` is the state under :data:`CONTEXT_STATE`)."""
    _check(q, plan)
    if any(round_.chunk_indices is None for round_ in plan.rounds):
        raise ValueError("the fla backend needs the chunk grid of every round; build the plan with "
                         "build_gated_delta_plan (it fills GatedDeltaRound.chunk_indices)")
    out, requested = _TreeGatedDeltaRuleFla.apply(q, k, v, g, beta, initial_state, plan, scale,
                                                  use_qk_l2norm_in_kernel)
    if not output_requested_states:
        return out
    return out, [None if key is None else requested[i] for i, key in enumerate(plan.requested_states)]


def tree_gated_delta_rule_fla_autograd(q, k, v, g, beta, plan: GatedDeltaPlan, *, scale: float,
                                       use_qk_l2norm_in_kernel: bool) -> torch.Tensor:
    """fla's public ``chunk_gated_delta_rule`` once per round, states handed over through autograd."""
    _check(q, plan)
    chunk_gated_delta_rule = _import_fla()[0]
    U, HV, V = v.shape
    K = k.shape[-1]
    states: dict = {}
    out_tokens, out_values = [], []
    for round_ in plan.rounds:
        round_ = _on(round_, q.device)
        index = round_.token_index
        zero = q.new_zeros(HV, K, V, dtype=torch.float32)
        initial = torch.stack([zero if key is None else states[key] for key in round_.initial_state])
        o, final = chunk_gated_delta_rule(
            q[index].unsqueeze(0), k[index].unsqueeze(0), v[index].unsqueeze(0),
            g[index].unsqueeze(0).float(), beta[index].unsqueeze(0),
            scale=scale, initial_state=initial, output_final_state=True,
            cu_seqlens=round_.cu_seqlens.long(), use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        for slot, _, key in round_.saved_states:
            states[key] = final[slot]
        out_tokens.append(round_.output_token)
        out_values.append(o[0, round_.output_position])
    out = v.new_zeros(U, HV, V)
    return out.index_copy(0, torch.cat(out_tokens), torch.cat(out_values).to(v.dtype))
