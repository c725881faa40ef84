"""The ``"fla"`` backend for per-channel gates (Kimi Delta Attention, CUDA only): fla's ``chunk_kda`` once per round
of the plan, varlen over the round's units, states handed between rounds through autograd.

The plan must be built with ``final_states_only=True`` (fla returns each unit's final state only; runs are cut at
the chunk boundaries their children restart from), as for the Gated DeltaNet nodes of :mod:`.fla_backend`. Each
round is one fla call (its own autograd node, its own recomputation in the backward): the plain per-round scheme,
without the round-batched node's shared stages. Checked through fla's Triton kernels on the CPU (Triton's
interpreter; ``scripts/check_fla_nodes_on_cpu.py``, ``check_kda``) against the torch backend.
"""

from __future__ import annotations

import torch

from . import fla_backend
from .plan import CONTEXT_STATE, GatedDeltaPlan

__all__ = ["import_fla_op", "per_round", "tree_kda_fla"]


def import_fla_op(module: str, name: str, what: str):
    """``module.name`` from fla, or an ImportError naming ``what`` needs it and how to install fla."""
    try:
        return getattr(__import__(module, fromlist=[name]), name)
    except ImportError as error:  # pragma: no cover - depends on the machine
        raise ImportError(f"{what} on the 'fla' backend needs flash-linear-attention >= 0.6 and triton on a CUDA "
                          "machine: pip install 'flash-linear-attention>=0.6,<0.7'") from error


def tree_kda_fla(q, k, v, g, beta, plan: GatedDeltaPlan, *, scale: float, use_qk_l2norm_in_kernel: bool,
                 initial_state: torch.Tensor | None = None, output_requested_states: bool = False):
    """Same contract as :func:`~.ops.tree_gated_delta_rule` with ``g [U + R, HV, K]`` (rows: packed, then the
    plan's context rows; ``initial_state``: the state under :data:`CONTEXT_STATE`)."""
    fla_backend._check(q, plan)
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
