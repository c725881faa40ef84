"""Tree gated delta rule: every unique token once, every path with its per-trajectory chunk grid.

Executes a :class:`GatedDeltaPlan` round by round; states handed between rounds stay fp32 and in the
autograd graph, so gradients of a child's initial state flow into its parent's recurrence and the
gradients of replayed inputs flow back to the parent's tokens (they are gathered, not copied). A forest cut
out below a branch point takes its root's state and replay rows from outside (``initial_state``,
``context``) and can hand states to its own cut-off children (``output_requested_states``).
"""

from __future__ import annotations

import torch

from .._backend import resolve_backend
from .chunked import chunk_gated_delta_rule_torch, prepare_inputs
from .plan import CONTEXT_STATE, GatedDeltaPlan, GatedDeltaRound

__all__ = ["tree_gated_delta_rule"]


def tree_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    plan: GatedDeltaPlan,
    *,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    backend: str = "auto",
    initial_state: torch.Tensor | None = None,
    context: tuple | None = None,
    output_requested_states: bool = False,
    delta: bool = True,
):
    """Gated delta rule over a packed forest.

    Args:
        q, k: ``[U, HK, K]``; v: ``[U, HV, V]`` with ``HV`` a multiple of ``HK`` (each key head serves
            ``HV // HK`` consecutive value heads); g: log decay (<= 0), ``[U, HV]`` one per head (Gated DeltaNet)
            or ``[U, HV, K]`` one per key channel (Kimi Delta Attention: fla's ``chunk_kda`` per round on the
            "fla" backend, :mod:`.fla_kda`); beta: ``[U, HV]``.
        plan: from :func:`build_gated_delta_plan` on the same packed forest (``final_states_only=True`` for fla).
        scale: query scale, default ``K ** -0.5``.
        use_qk_l2norm_in_kernel: L2-normalise q and k first (in fp32), as Qwen3-Next / Qwen3.5 do.
        backend: ``"auto"`` (fla on CUDA when installed, else torch), ``"torch"`` or ``"fla"``.
        initial_state: ``[HV, K, V]`` fp32, the state at the plan's :data:`CONTEXT_STATE` (a forest whose root sits
            at depth ``d0 > 0``: the state on its root path after ``C * (d0 // C)`` tokens); None = zeros.
        context: ``(q, k, v, g, beta)`` of the ``plan.context_tokens`` ancestors the root replays (depths
            ``C * (d0 // C) .. d0 - 1``, oldest first; shapes as above with ``R`` rows), or None when there are none.
        output_requested_states: also return the states of the plan's ``state_requests``.
        delta: False drops the delta rule's correction (``S = exp(g) S + k (beta v)^T``: gated linear attention, the
            form Mamba-2's state-space duality takes with ``q = C``, ``k = B``, ``v = dt x``, ``g = dt A``); on the
            "fla" backend fla's ``chunk_simple_gla`` stages, the state pass per round (:mod:`.fla_simple_gla`).

    Returns:
        ``o [U, HV, V]`` in ``q.dtype``; with ``output_requested_states``, ``(o, states)``: one ``[HV, K, V]`` fp32
        state (or None for zeros) per state request, in the autograd graph.
    """
    U, HK, K = k.shape
    HV = v.shape[1]
    if q.shape != k.shape or v.shape[0] != U or g.shape not in ((U, HV), (U, HV, K)) or beta.shape != (U, HV):
        raise ValueError(
            f"tree_gated_delta_rule: expected q, k [U, HK, K], v [U, HV, V], g [U, HV] or [U, HV, K] and beta [U, HV]; "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, g {tuple(g.shape)}, beta "
            f"{tuple(beta.shape)}")
    if HV % HK:
        raise ValueError(f"tree_gated_delta_rule: value heads ({HV}) must be a multiple of key heads ({HK})")
    if plan.num_tokens != U:
        raise ValueError(f"tree_gated_delta_rule: the plan covers {plan.num_tokens} tokens but the inputs have {U}; "
                         "build the plan from the same packed forest.")
    context_rows = 0 if context is None else context[0].shape[0]
    if context_rows != plan.context_tokens:
        raise ValueError(f"tree_gated_delta_rule: the plan replays {plan.context_tokens} context rows but "
                         f"{context_rows} were given; pass context=(q, k, v, g, beta) of the root's ancestors at "
                         "depths C * (d0 // C) .. d0 - 1")
    if context is not None:
        if len(context) != 5 or any(c.shape[1:] != x.shape[1:] or c.shape[0] != context_rows
                                    for c, x in zip(context, (q, k, v, g, beta))):
            raise ValueError("tree_gated_delta_rule: context must be (q, k, v, g, beta) with R rows each, shaped as "
                             f"the packed inputs; got {[tuple(c.shape) for c in context]}")
    if initial_state is not None and initial_state.shape != (HV, K, v.shape[-1]):
        raise ValueError(f"tree_gated_delta_rule: initial_state must be [HV={HV}, K={K}, V={v.shape[-1]}], got "
                         f"{tuple(initial_state.shape)}")
    if initial_state is None and any(key == CONTEXT_STATE for r in plan.rounds for key in r.initial_state):
        raise ValueError("tree_gated_delta_rule: the forest's root starts past a chunk boundary of its path; pass "
                         "initial_state, the state on its root path at that boundary (from its source's hand-off)")
    scale = K ** -0.5 if scale is None else scale
    if not delta and g.dim() == 3:
        raise ValueError("tree_gated_delta_rule: delta=False takes one gate per head, g [U, HV]")
    backend = resolve_backend(backend, q, "tree_gated_delta_rule")
    if backend == "fla" and not delta:  # gated linear attention (Mamba-2); context rows read in place
        from .fla_simple_gla import tree_simple_gla_fla

        return tree_simple_gla_fla(q, k, v, g, beta, plan, scale=scale, initial_state=initial_state,
                                   output_requested_states=output_requested_states, context=context)
    if backend == "fla" and g.dim() == 3:  # per-channel gates (KDA); context rows read in place
        from .fla_kda import tree_kda_fla

        return tree_kda_fla(q, k, v, g, beta, plan, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                            initial_state=initial_state, output_requested_states=output_requested_states,
                            context=context)
    if backend == "fla":  # Gated DeltaNet; context rows read in place by the round-batched node
        from .fla_backend import tree_gated_delta_rule_fla

        return tree_gated_delta_rule_fla(q, k, v, g, beta, plan, scale=scale,
                                         use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                         initial_state=initial_state, output_requested_states=output_requested_states,
                                         context=context)
    if context is not None:  # the torch path takes the context rows below the packed ones
        q, k, v, g, beta = (torch.cat([x, c.to(x.dtype)]) for x, c in zip((q, k, v, g, beta), context))
    # the torch path computes in fp32 (fp64 stays fp64), as fla's kernels do; autocast would run its products in
    # bf16, and the triangular solve has no bf16 CPU kernel
    with torch.autocast(q.device.type, enabled=False):
        out, states = _tree_gated_delta_rule_torch(q, k, v, g, beta, plan, scale, use_qk_l2norm_in_kernel,
                                                   initial_state, delta)
    if not output_requested_states:
        return out
    return out, [None if key is None else states[key] for key in plan.requested_states]


def _tree_gated_delta_rule_torch(q, k, v, g, beta, plan, scale, use_qk_l2norm_in_kernel, initial_state=None,
                                 delta=True):
    """``[U + R]`` rows (packed, then context) -> ``(o [U, HV, V], states by key)``."""
    dtype = q.dtype
    U, rows, HV = plan.num_tokens, v.shape[0], v.shape[1]
    q, k, v, g, beta = prepare_inputs(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    # one zero row at index U + R: padding that leaves the state unchanged (k = v = beta = g = 0)
    q, k, v, g, beta = (torch.cat([x, x.new_zeros(1, *x.shape[1:])]) for x in (q, k, v, g, beta))

    states: dict = {}
    if initial_state is not None:
        states[CONTEXT_STATE] = initial_state.to(q.dtype)
    out_tokens, out_values = [], []
    for round_ in plan.rounds:
        tokens, values = _run_round(round_, q, k, v, g, beta, states, plan.chunk_size, rows, delta)
        out_tokens.append(tokens)
        out_values.append(values)
    out = v.new_zeros(U, HV, v.shape[-1])
    out = out.index_copy(0, torch.cat(out_tokens), torch.cat(out_values))
    return out.to(dtype), states


def _run_round(round_: GatedDeltaRound, q, k, v, g, beta, states, chunk_size, pad_row, delta=True):
    device = q.device
    round_ = round_ if round_.token_index.device == device else round_.to(device)
    lengths = (round_.cu_seqlens[1:] - round_.cu_seqlens[:-1]).long()
    n = lengths.shape[0]
    padded = int(((lengths.max() + chunk_size - 1) // chunk_size * chunk_size).item())
    row = torch.repeat_interleave(torch.arange(n, device=device), lengths)
    column = torch.arange(row.shape[0], device=device) - round_.cu_seqlens[:-1].long()[row]
    index = torch.full((n, padded), pad_row, dtype=torch.long, device=device)
    index[row, column] = round_.token_index

    def take(x):  # [U + 1, H, ...] -> [n, H, padded, ...]
        return x[index].transpose(1, 2)

    H, K, V = q.shape[1], q.shape[2], v.shape[2]
    zero = q.new_zeros(H, K, V)
    initial = torch.stack([zero if key is None else states[key] for key in round_.initial_state])
    wanted = sorted({chunks for _, chunks, _ in round_.saved_states if chunks is not None})
    o, chunk_states = chunk_gated_delta_rule_torch(
        take(q), take(k), take(v), take(g), take(beta), initial, chunk_size, state_chunks=wanted, delta=delta)
    for slot, chunks, key in round_.saved_states:
        states[key] = chunk_states["final" if chunks is None else chunks][slot]
    o = o.transpose(1, 2)  # [n, padded, H, V]
    out_row = row[round_.output_position]
    out_column = column[round_.output_position]
    return round_.output_token, o[out_row, out_column]
