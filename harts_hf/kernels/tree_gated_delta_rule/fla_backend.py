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

With :data:`BATCH_ROUNDS` set, :class:`_TreeGatedDeltaRuleFlaBatched` replaces the fused node: only fla's state
pass (forward) and state-gradient pass (backward) depend on a unit's initial state, so every other stage of the
chunk pipeline (gate cumsum, intra-chunk solve, w/u, output, dv/dq/dk/dw, WY backward) runs ONCE over the executed
tokens of all rounds, laid out round after round; per round only ``chunk_gated_delta_rule_fwd_h`` (and
``_bwd_dhu`` in the backward) runs on that round's slice. Every kernel works chunk by chunk, so the arithmetic is
the per-round node's; the launches per round drop from ~20 to 3. Checked through fla's own Triton kernels on the
CPU (Triton's interpreter, fp32; ``scripts/check_fla_nodes_on_cpu.py``): bit-identical to the fused node and within
1e-6 of the torch backend, hand-offs included; on the H200 bit-identical outputs to the fused node and 2.7x faster
per layer on ``swe`` (BENCHMARKS.md, fourth GPU session). ``BATCH_ROUNDS = False`` selects the fused per-round node.

:data:`STATE_PASS` picks the round-batched node's state pass: ``"rounds"`` (fla's, once per round), ``"serial"``
(:mod:`.serial_state_pass`: all units in one launch forward and one backward, one program per value head and block
of value columns walking every chunk of every unit in turn) or ``"auto"`` (the default: per plan, whichever
:func:`state_pass_for` estimates faster). Measured per layer on the H200 (BENCHMARKS.md, fifth GPU session): the
serial pass takes swe@0.02's GDN fwd+bwd from 11.6 ms to 6.7 ms, the time of ONE varlen fla call over the same
tokens; at the model level it is faster on swe and tau and slower on grpo (2 rounds, 154 chunks in a row).
"""

from __future__ import annotations

import functools

import torch

from .. import cuda_graphs, kept
from .._backend import in_row_blocks
from .plan import CONTEXT_STATE, GatedDeltaPlan
from .round_batch import RoundBatch, round_batch
from .serial_state_pass import one_save_per_unit, serial_units, tree_state_backward, tree_state_forward

BATCH_ROUNDS = True  # False: the fused per-round node (see the module docstring)
PUBLIC_PER_ROUND = False
"""True: fla's public ``chunk_gated_delta_rule`` once per round (:func:`tree_gated_delta_rule_fla_autograd`), which
fla dispatches to its backends, FlashQLA among them (the benchmarks' ``fused_fa4_public_gdn`` kernel set). False:
harts_hf's own nodes over fla's Triton stages (above), the default: on the H200 with flash-qla 0.1.3 installed the
public path took full-size ``tau``'s tree step from 5.08 to 7.10 s, at a 9 GiB lower peak (BENCHMARKS.md)."""
# The round-batched node's state pass: "rounds" (fla's state pass once per round), "serial" (every unit in one
# launch per direction, harts_hf.kernels.tree_gated_delta_rule.serial_state_pass), "lanes" (the serial kernels on
# heavy-path lanes, one launch per wave; exact, and on the H200 never faster than "serial": ~2 programs per SM
# fit at 255 registers, so ~2 lanes run at once; "auto" does not pick it) or "auto"
# (state_pass_for).
STATE_PASS = "auto"
_STATE_PASSES = ("auto", "rounds", "serial", "lanes")
SERIAL_ROUND_CHUNKS = 1000
"""What one round of fla's state pass costs beyond its longest unit, in chunk steps of the serial pass (host work,
three launches, the bank gather/scatter, and a round's units beyond what runs at once). Measured on the H200 (fwd+bwd
of one 2B-shaped GDN layer, BENCHMARKS.md): the serial pass was faster on every forest of more than one round timed:
swe@0.02, tau@0.02, swe@0.05 (fifth GPU session, model level), grpo@0.05 (5.2 vs 6.8 ms; chains of 154 vs 6 chunk
steps over 2 rounds), full-size tau (48.4 vs 51.4 ms; 1,621 vs 332 over 13 rounds) and full-size swe (200.5 vs
212.0 ms; 6,802 vs 386 over 8 rounds; tenth session). 120, the earlier value, sent full-size swe to the per-round
pass; 1000 sends every timed forest to the serial one and keeps the per-round pass for rounds of many long
siblings (64 completions of 4k tokens: 4,096 serial steps vs 64 per round), for one round, and where a unit's state
is saved twice."""


def _import_fla():
    try:
        from fla.modules.norm.l2norm import l2norm_bwd, l2norm_fwd
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_bwd, chunk_gated_delta_rule_fwd
    except ImportError as error:  # pragma: no cover - depends on the machine
        raise ImportError("the 'fla' backend needs flash-linear-attention >= 0.6 and triton on a CUDA machine: "
                          "pip install 'flash-linear-attention>=0.6,<0.7'") from error
    return chunk_gated_delta_rule, chunk_gated_delta_rule_fwd, chunk_gated_delta_rule_bwd, l2norm_fwd, l2norm_bwd


def _import_fla_stages():
    """fla 0.6's chunk-pipeline stages (the functions its own ``chunk_gated_delta_rule_fwd/_bwd`` call)."""
    try:
        from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu, chunk_gated_delta_rule_fwd_h
        from fla.ops.common.chunk_o import chunk_bwd_dqkwg, chunk_bwd_dv_local, chunk_fwd_o
        from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
        from fla.ops.gated_delta_rule.wy_fast import prepare_wy_repr_bwd, recompute_w_u_fwd
        from fla.ops.utils import chunk_local_cumsum
        from fla.ops.utils.constant import RCP_LN2
    except ImportError as error:  # pragma: no cover - depends on the machine
        raise ImportError("BATCH_ROUNDS needs fla 0.6's chunk stages (fla.ops.common.chunk_delta_h, chunk_o, "
                          "gated_delta_rule.chunk_fwd / wy_fast); set fla_backend.BATCH_ROUNDS = False") from error
    return dict(fwd_h=chunk_gated_delta_rule_fwd_h, bwd_dhu=chunk_gated_delta_rule_bwd_dhu, fwd_o=chunk_fwd_o,
                bwd_dv_local=chunk_bwd_dv_local, bwd_dqkwg=chunk_bwd_dqkwg, fwd_intra=chunk_gated_delta_rule_fwd_intra,
                wy_bwd=prepare_wy_repr_bwd, recompute_w_u=recompute_w_u_fwd, cumsum=chunk_local_cumsum,
                rcp_ln2=RCP_LN2)


def _state_pass(stages, batch: RoundBatch, plan: GatedDeltaPlan, k, w, u, g, initials, bank=None, gate: str = "g"):
    """fla's state pass round by round. Forward (``bank`` given): each round's initial states are gathered from the
    state bank into ``initials`` and its saved final states scattered back; backward recomputation (``bank``
    None): ``initials`` are the saved per-round initial states. ``gate``: the keyword ``g`` takes (``"g"``, one
    gate per head; ``"gk"``, one per key channel: Kimi Delta Attention). Returns ``h`` and ``v_new`` of all rounds."""
    hs, v_news = [], []
    for r in range(len(plan.rounds)):
        t = batch.tokens[r]
        if bank is not None:
            initials.append(bank[batch.initial_ids[r]])
        h, v_new, final = stages["fwd_h"](
            k=k[:, t], w=w[:, t], u=u[:, t], **{gate: g[:, t]}, initial_state=initials[r],
            output_final_state=bank is not None, chunk_size=plan.chunk_size, cu_seqlens=batch.round_cu[r],
            chunk_indices=batch.round_chunk_indices[r], chunk_offsets=batch.round_chunk_offsets[r])
        if bank is not None:
            bank.index_copy_(0, batch.save_ids[r], final[batch.save_slots[r]])
        hs.append(h)
        v_news.append(v_new)
    return _joined(hs), _joined(v_news)


def _joined(parts: list) -> torch.Tensor:
    """The rounds' parts along the token / chunk dimension (one part as it is: a concatenation would copy it)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, 1)


def _state_gradient_pass(stages, batch: RoundBatch, plan: GatedDeltaPlan, qe, ke, w, g, do, dv, initials, d_bank,
                         scale, gate: str = "g"):
    """fla's state-gradient pass round by round, in reverse: every unit that starts from a state runs in a later
    round than the one saving it, so a row of ``d_bank`` is complete (requested-state gradients plus every
    starting unit's) before the unit that saved it reads it. ``gate`` as for :func:`_state_pass`. Returns ``dh``
    and ``dv2`` of all rounds."""
    dh_parts, dv_parts = [None] * len(plan.rounds), [None] * len(plan.rounds)
    for r in reversed(range(len(plan.rounds))):
        t = batch.tokens[r]
        dht = torch.zeros_like(initials[r]).index_copy_(0, batch.save_slots[r], d_bank[batch.save_ids[r]])
        dh_parts[r], dh0, dv_parts[r] = stages["bwd_dhu"](
            q=qe[:, t], k=ke[:, t], w=w[:, t], do=do[:, t], dv=dv[:, t], **{gate: g[:, t]}, h0=initials[r],
            dht=dht, scale=scale, cu_seqlens=batch.round_cu[r], chunk_size=plan.chunk_size,
            chunk_indices=batch.round_chunk_indices[r], chunk_offsets=batch.round_chunk_offsets[r])
        d_bank.index_add_(0, batch.initial_ids[r], dh0)
    return _joined(dh_parts), _joined(dv_parts)


def _state_bank(batch: RoundBatch, initial_state, HV: int, K: int, V: int, device) -> torch.Tensor:
    """The fp32 state bank of a forward: zeros, and the handed-in state in its row."""
    bank = torch.zeros(batch.num_states, HV, K, V, dtype=torch.float32, device=device)
    if batch.context_id is not None and initial_state is not None:
        bank[batch.context_id] = initial_state.float()
    return bank


def state_pass_for(plan: GatedDeltaPlan) -> str:
    """``"serial"``, ``"lanes"`` or ``"rounds"`` for ``plan`` under :data:`STATE_PASS`. ``"auto"`` compares the
    serial pass's chain (every chunk of every unit, one after another) with the per-round pass (the longest unit of
    each round, plus :data:`SERIAL_ROUND_CHUNKS` per round), from the host copy of the plan (no device reads); it
    does not pick ``"lanes"`` (timed on the H200 at 1.00-1.13x the serial pass's time, never faster). A plan that
    saves one unit's state under two keys (which the serial pass does not keep) takes the rounds, and so does a plan
    of one round (one launch of fla's own state pass either way: a single sequence is exactly fla's kernel)."""
    if STATE_PASS not in _STATE_PASSES:
        raise ValueError(f"fla_backend.STATE_PASS must be one of {_STATE_PASSES}, got {STATE_PASS!r}")
    if STATE_PASS != "auto":
        return STATE_PASS
    cache = plan.__dict__.setdefault("_state_pass", {})
    if "auto" not in cache:
        batch = round_batch(plan, torch.device("cpu"))
        counts = [offsets[1:] - offsets[:-1] for offsets in batch.round_chunk_offsets]
        serial = sum(int(c.sum()) for c in counts)
        rounds = sum(int(c.max()) + SERIAL_ROUND_CHUNKS for c in counts if c.numel())
        single = len(counts) <= 1
        cache["auto"] = "serial" if serial <= rounds and not single and one_save_per_unit(batch) else "rounds"
    return cache["auto"]


class _TreeGatedDeltaRuleFlaBatched(torch.autograd.Function):
    """Same contract as :class:`_TreeGatedDeltaRuleFla`; state-independent stages batched over all rounds. Forward
    and backward bodies go through :func:`~harts_hf.kernels.cuda_graphs.replay_or_run`: on a small forest, one CUDA
    graph per plan replayed by every layer."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, plan, scale, use_qk_l2norm_in_kernel, *context):
        state_pass = state_pass_for(plan)
        body = functools.partial(_batched_forward, plan=plan, scale=scale, l2norm=use_qk_l2norm_in_kernel,
                                 state_pass=state_pass)
        out, requested, q_normed, k_normed, q_rstd, k_rstd, g_cumsum, A, cq, ck, cq_rstd, ck_rstd, *initials = \
            cuda_graphs.replay_or_run(plan, ("gdn_forward", scale, use_qk_l2norm_in_kernel, state_pass),
                                      plan.stats["executed_tokens"], body, (q, k, v, g, beta, initial_state, *context))
        if use_qk_l2norm_in_kernel:
            q, k = q_normed, k_normed
        cv, cb = (context[2], context[4]) if context else (None, None)
        ctx.save_for_backward(q, k, v, beta, q_rstd, k_rstd, g_cumsum, A, cq, ck, cv, cb, cq_rstd, ck_rstd,
                              *initials)
        ctx.plan, ctx.scale, ctx.use_qk_l2norm_in_kernel = plan, scale, use_qk_l2norm_in_kernel
        ctx.g_dtype, ctx.initial_dtype = g.dtype, None if initial_state is None else initial_state.dtype
        ctx.state_pass, ctx.context_g_dtype = state_pass, context[3].dtype if context else None
        return out, requested

    @staticmethod
    def backward(ctx, d_out, d_requested):
        q, k, v, beta, q_rstd, k_rstd, g_cumsum, A, cq, ck, cv, cb, cq_rstd, ck_rstd, *initials = ctx.saved_tensors
        plan = ctx.plan
        body = functools.partial(_batched_backward, plan=plan, scale=ctx.scale, l2norm=ctx.use_qk_l2norm_in_kernel,
                                 state_pass=ctx.state_pass, g_dtype=ctx.g_dtype, initial_dtype=ctx.initial_dtype,
                                 context_g_dtype=ctx.context_g_dtype)
        grads = cuda_graphs.replay_or_run(
            plan, ("gdn_backward", ctx.scale, ctx.use_qk_l2norm_in_kernel, ctx.state_pass, ctx.g_dtype,
                   ctx.initial_dtype, ctx.context_g_dtype), plan.stats["executed_tokens"], body,
            (q, k, v, beta, q_rstd, k_rstd, g_cumsum, A, d_out, d_requested, cq, ck, cv, cb, cq_rstd, ck_rstd,
             *initials))
        own, context_grads = grads[:6], grads[6:]
        return (*own, None, None, None, *context_grads)


def _batched_forward(q, k, v, g, beta, initial_state, *context, plan, scale, l2norm, state_pass):
    """The round-batched node's forward: ``(o, requested states, q and k normalised (None without the L2 norm), their
    rstd, g_cumsum, A, the context rows' q and k as the backward reads them and their rstd (None without context
    rows), *initial states the backward reruns the state pass from)``. ``context``: none, or a planner piece's
    context rows ``(q, k, v, g, beta)``, gathered into the executed layout in place."""
    stages, l2norm_fwd = _import_fla_stages(), _import_fla()[3]
    HV, V = v.shape[1], v.shape[2]
    K = k.shape[-1]
    batch = round_batch(plan, q.device)
    q, k, q_rstd, k_rstd, (cq, ck, cv, cg, cb), cq_rstd, ck_rstd = normed_inputs(l2norm_fwd, l2norm, q, k, context)
    grid = dict(cu_seqlens=batch.cu_seqlens, chunk_indices=batch.chunk_indices)
    qe, ke, ve, be = (batch.executed(x, c) for x, c in ((q, cq), (k, ck), (v, cv), (beta, cb)))
    g_cumsum = stages["cumsum"](batch.executed(g, cg).float(), chunk_size=plan.chunk_size, scale=stages["rcp_ln2"],
                                **grid)
    w, u, A = stages["fwd_intra"](k=ke, v=ve, g=g_cumsum, beta=be, chunk_size=plan.chunk_size, **grid)
    del ve, be
    # the state pass and the output stage: kept from the forward where checkpointing keeps mixer outputs (not in a
    # body CUDA graphs may replay: a replayed forward would leave the rerun nothing to take back)
    body = functools.partial(_forward_states_and_output, plan=plan, scale=scale, state_pass=state_pass,
                             shape=(HV, K, V), dtype=v.dtype)
    inputs = (qe, ke, w, u, g_cumsum, initial_state)
    out, requested, *initials = body(*inputs) if cuda_graphs.eligible(plan.stats["executed_tokens"], q) else \
        kept.run(body, inputs)
    if state_pass != "rounds" and initial_state is not None:  # the recomputation rebuilds the bank from it
        initials.append(initial_state)
    return (out, requested, q if l2norm else None, k if l2norm else None, q_rstd, k_rstd, g_cumsum, A, cq, ck, cq_rstd,
            ck_rstd, *initials)


def _forward_states_and_output(qe, ke, w, u, g_cumsum, initial_state, *, plan, scale, state_pass, shape,
                               dtype) -> tuple:
    """The round-batched node's state pass and output stage (the executed layout's inputs): ``o [U, HV, V]`` in
    ``dtype``, the requested states (fp32) and, for fla's per-round pass, each round's initial states; ``shape``:
    ``(HV, K, V)``."""
    stages = _import_fla_stages()
    batch = round_batch(plan, qe.device)
    bank = _state_bank(batch, initial_state, *shape, qe.device)
    initials: list = []
    h, v_new = states_forward(stages, batch, plan, state_pass, ke, w, u, g_cumsum, bank, initials)
    o = stages["fwd_o"](q=qe, k=ke, v=v_new, h=h, g=g_cumsum, scale=scale, chunk_size=plan.chunk_size,
                        cu_seqlens=batch.cu_seqlens, chunk_indices=batch.chunk_indices)
    return (batch.own_outputs(o[0]).to(dtype), bank[batch.requested_ids], *initials)


def _batched_backward(q, k, v, beta, q_rstd, k_rstd, g_cumsum, A, d_out, d_requested, cq, ck, cv, cb, cq_rstd,
                      ck_rstd, *initials, plan, scale, l2norm, state_pass, g_dtype, initial_dtype, context_g_dtype):
    """The round-batched node's backward: the gradients of ``q, k, v, g, beta``, the handed-in state (or None) and,
    with context rows (``cq``... as the forward saved them; ``context_g_dtype`` their gate's dtype, None without),
    theirs."""
    stages, l2norm_bwd = _import_fla_stages(), _import_fla()[4]
    batch = round_batch(plan, q.device)
    U, HV, V = v.shape
    rows = U + (0 if cv is None else cv.shape[0])
    grid = dict(cu_seqlens=batch.cu_seqlens, chunk_indices=batch.chunk_indices)
    qe, ke, ve, be = (batch.executed(x, c) for x, c in ((q, cq), (k, ck), (v, cv), (beta, cb)))
    w, u = stages["recompute_w_u"](k=ke, v=ve, beta=be, A=A, g=g_cumsum, **grid)
    if state_pass != "rounds":
        bank = _state_bank(batch, initials[0] if initials else None, HV, k.shape[-1], V, q.device)
        h, v_new = states_forward(stages, batch, plan, state_pass, ke, w, u, g_cumsum, bank, [])
    else:  # from the saved initial states of every round
        h, v_new = _state_pass(stages, batch, plan, ke, w, u, g_cumsum, list(initials))
    do = batch.executed_grad(d_out)
    dv = stages["bwd_dv_local"](q=qe, k=ke, g=g_cumsum, do=do, scale=scale, chunk_size=plan.chunk_size, **grid)
    # gradient flowing into every bank row: from requested states, then from the units that started from it
    # (rounds in reverse: every unit that starts from a state runs in a later round than the one saving it)
    d_bank = batch.bank_grad(torch.empty(batch.num_states, HV, k.shape[-1], V, dtype=torch.float32,
                                         device=v.device), d_requested)
    dh, dv = states_backward(stages, batch, plan, state_pass, qe, ke, w, g_cumsum, do, dv, initials, d_bank, scale)
    d_state = {} if batch.context_id is None else {CONTEXT_STATE: d_bank[batch.context_id]}
    dq_e, dk_e, dw, dg_e = stages["bwd_dqkwg"](q=qe, k=ke, v=v_new, w=w, g=g_cumsum, h=h, dv=dv, do=do, dh=dh,
                                               scale=scale, chunk_size=plan.chunk_size, **grid)
    dk2, dv_e, db_e, dg2 = stages["wy_bwd"](k=ke, v=ve, beta=be, g=g_cumsum, A=A, dw=dw, du=dv, **grid)
    dk_e.add_(dk2)
    dg_e.add_(dg2)
    dg_e = stages["cumsum"](dg_e, chunk_size=plan.chunk_size, reverse=True, **grid)
    grads = [batch.sum_by_token(grad[0].float(), rows) for grad in (dq_e, dk_e, dv_e, dg_e, db_e)]
    return node_input_grads(l2norm, g_dtype, initial_dtype, context_g_dtype, l2norm_bwd,
                            (q, k, v, beta, q_rstd, k_rstd), (cq, ck, cv, cb, cq_rstd, ck_rstd), grads, d_state)


def normed_inputs(l2norm_fwd, l2norm: bool, q, k, context: tuple) -> tuple:
    """``(q, k, q_rstd, k_rstd, context, cq_rstd, ck_rstd)`` of a round-batched node's forward: q and k through fla's
    L2 norm where ``l2norm`` (rstd None otherwise), and a planner piece's context rows ``(q, k, v, g, beta)`` (five
    Nones without them) with their q and k normalised the same way, apart."""
    cq, ck, cv, cg, cb = context or (None,) * 5
    q_rstd = k_rstd = cq_rstd = ck_rstd = None
    if l2norm:
        q, q_rstd = _l2norm(l2norm_fwd, q)
        k, k_rstd = _l2norm(l2norm_fwd, k)
        if context:
            cq, cq_rstd = _l2norm(l2norm_fwd, cq)
            ck, ck_rstd = _l2norm(l2norm_fwd, ck)
    return q, k, q_rstd, k_rstd, (cq, ck, cv, cg, cb), cq_rstd, ck_rstd


def node_input_grads(l2norm: bool, g_dtype, initial_dtype, context_g_dtype, l2norm_bwd, saved, saved_context, grads,
                     d_state) -> tuple:
    """A round-batched node's input gradients from fp32 ``grads`` of q, k, v, g, beta over the ``U`` packed rows then
    the context rows (:func:`input_grads`): the packed rows' five and the handed-in state's, then, with context rows
    (``context_g_dtype`` their gate's dtype, None without; ``saved_context`` their ``(q, k, v, beta, q_rstd, k_rstd)``
    as the forward kept them), the context rows' five, views of the same buffers through their own L2 norm."""
    U = saved[2].shape[0]
    own = input_grads(l2norm, g_dtype, initial_dtype, l2norm_bwd, saved, [grad[:U] for grad in grads], d_state)
    if context_g_dtype is None:
        return own
    return (*own, *input_grads(l2norm, context_g_dtype, None, l2norm_bwd, saved_context, [grad[U:] for grad in grads],
                               {})[:5])


def states_forward(stages, batch: RoundBatch, plan: GatedDeltaPlan, state_pass: str, k, w, u, g, bank, initials,
                   gate: str = "g"):
    """``h`` and ``v_new`` of every round from the state ``bank`` (final states written into it): the serial state
    pass (``state_pass`` "serial" or "lanes", :mod:`.serial_state_pass`) or fla's once per round (``"rounds"``, each
    round's initial states appended to ``initials``). ``gate`` as for :func:`_state_pass`."""
    if state_pass != "rounds":
        units = serial_units(plan, k.device, lanes=state_pass == "lanes")
        return tree_state_forward(units, k, w, u, g, bank, plan.chunk_size)
    return _state_pass(stages, batch, plan, k, w, u, g, initials, bank, gate=gate)


def states_backward(stages, batch: RoundBatch, plan: GatedDeltaPlan, state_pass: str, q, k, w, g, do, dv, initials,
                    d_bank, scale: float, gate: str = "g"):
    """``dh`` and ``dv2`` of every round, the state-gradient pass of :func:`states_forward`'s choice (``initials``:
    each round's initial states, for fla's per-round pass)."""
    if state_pass != "rounds":
        units = serial_units(plan, q.device, lanes=state_pass == "lanes")
        return tree_state_backward(units, q, k, w, g, do, dv, d_bank, scale, plan.chunk_size)
    return _state_gradient_pass(stages, batch, plan, q, k, w, g, do, dv, initials, d_bank, scale, gate=gate)


def input_grads(l2norm: bool, g_dtype, initial_dtype, l2norm_bwd, saved, grads, d_state) -> tuple:
    """The gradients of ``q, k, v, g, beta`` and the handed-in state (None without one) from fp32 gradients in the
    normalised q / k: through the L2 norm (``l2norm``), cast to the inputs' dtypes (``g_dtype``, ``initial_dtype``:
    g's and the handed-in state's, None without one)."""
    q, k, v, beta, q_rstd, k_rstd = saved
    dq, dk, dv, dg, dbeta = grads
    if l2norm:
        dq = _l2norm_grad(l2norm_bwd, q, q_rstd, dq)
        dk = _l2norm_grad(l2norm_bwd, k, k_rstd, dk)
    d_initial = None
    if initial_dtype is not None and CONTEXT_STATE in d_state:
        d_initial = d_state.pop(CONTEXT_STATE).to(initial_dtype)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g_dtype), dbeta.to(beta.dtype), d_initial


def _l2norm(l2norm_fwd, x):
    """fla's L2 norm of ``x [T, H, D]`` over its rows in blocks that stay in its first autotuning bucket."""
    y, rstd = in_row_blocks(l2norm_fwd, x.reshape(-1, x.shape[-1]))
    return y.view(x.shape), rstd.view(x.shape[:-1])


def _l2norm_grad(l2norm_bwd, y, rstd, dy):
    flat = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731
    return in_row_blocks(l2norm_bwd, flat(y), rstd.reshape(-1), flat(dy)).view(dy.shape)


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
            q, q_rstd = _l2norm(l2norm_fwd, q)
            k, k_rstd = _l2norm(l2norm_fwd, k)
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
        return (*input_grads(ctx.use_qk_l2norm_in_kernel, ctx.g_dtype, ctx.initial_dtype, l2norm_bwd,
                             (q, k, v, beta, q_rstd, k_rstd), (dq, dk, dv, dg, dbeta), d_state), None, None, None)


def tree_gated_delta_rule_fla(q, k, v, g, beta, plan: GatedDeltaPlan, *, scale: float,
                              use_qk_l2norm_in_kernel: bool, initial_state: torch.Tensor | None = None,
                              output_requested_states: bool = False, context: tuple | None = None):
    """Same contract as :func:`tree_gated_delta_rule` (``[U, H, D]`` rows on CUDA, and ``context`` (or None) the
    plan's context rows ``(q, k, v, g, beta)``, read in place by the round-batched node and concatenated below the
    packed rows for the others; ``initial_state`` is the state under :data:`CONTEXT_STATE`)."""
    _check(q, plan)
    if any(round_.chunk_indices is None for round_ in plan.rounds):
        raise ValueError("the fla backend needs the chunk grid of every round; build the plan with "
                         "build_gated_delta_plan (it fills GatedDeltaRound.chunk_indices)")
    if BATCH_ROUNDS and not PUBLIC_PER_ROUND:
        return node_result(_TreeGatedDeltaRuleFlaBatched.apply(q, k, v, g, beta, initial_state, plan, scale,
                                                               use_qk_l2norm_in_kernel, *(context or ())),
                           plan, output_requested_states)
    if context is not None:
        q, k, v, g, beta = (torch.cat([x, c.to(x.dtype)]) for x, c in zip((q, k, v, g, beta), context))
    if PUBLIC_PER_ROUND:
        return tree_gated_delta_rule_fla_autograd(q, k, v, g, beta, plan, scale=scale,
                                                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                                  initial_state=initial_state,
                                                  output_requested_states=output_requested_states)
    return node_result(_TreeGatedDeltaRuleFla.apply(q, k, v, g, beta, initial_state, plan, scale,
                                                    use_qk_l2norm_in_kernel), plan, output_requested_states)


def node_result(result: tuple, plan: GatedDeltaPlan, output_requested_states: bool):
    """A round-batched node's ``(o, requested states stacked)`` as :func:`~.ops.tree_gated_delta_rule` returns it:
    ``o``, or ``(o, [state or None per request])``."""
    out, requested = result
    if not output_requested_states:
        return out
    return out, [None if key is None else requested[i] for i, key in enumerate(plan.requested_states)]


def tree_gated_delta_rule_fla_autograd(q, k, v, g, beta, plan: GatedDeltaPlan, *, scale: float,
                                       use_qk_l2norm_in_kernel: bool, initial_state: torch.Tensor | None = None,
                                       output_requested_states: bool = False):
    """fla's public ``chunk_gated_delta_rule`` once per round, states handed over through autograd: fla picks its
    backend per call (on Hopper FlashQLA's TileLang kernels where ``flash_qla`` is importable, its checks pass and
    ``FLA_FLASH_QLA`` is not 0). Same contract as :func:`tree_gated_delta_rule_fla`."""
    _check(q, plan)
    chunk_gated_delta_rule = _import_fla()[0]
    U, HV, V = plan.num_tokens, v.shape[1], v.shape[2]
    K = k.shape[-1]
    states: dict = {} if initial_state is None else {CONTEXT_STATE: initial_state.float()}
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
    out = v.new_zeros(U, HV, V).index_copy(0, torch.cat(out_tokens), torch.cat(out_values).to(v.dtype))
    if not output_requested_states:
        return out
    return out, [None if key is None else states[key] for key in plan.requested_states]
