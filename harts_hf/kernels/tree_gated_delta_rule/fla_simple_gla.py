"""The ``"fla"`` backend without the delta rule (gated linear attention: Mamba-2's scan, CUDA only): fla's
``chunk_simple_gla`` once per round of the plan, varlen over the round's units, states handed between rounds through
autograd, on the plan's own chunk grid (fla's ``chunk_size``: Mamba-2's 128 where the mixer says so).

Keys and queries are repeated to the value heads (fla's kernel takes one key head per value head) and ``beta``
scales the values (``S = exp(g) S + k (beta v)^T``). The plan must be built with ``final_states_only=True``, as for
:mod:`.fla_backend` and :mod:`.fla_kda`. Checked through fla's Triton kernels on the CPU (Triton's interpreter;
``scripts/check_fla_nodes_on_cpu.py``, ``check_round_nodes`` and ``check_mamba2_model``) against the torch backend.
"""

from __future__ import annotations

import torch

from . import fla_backend
from .plan import CONTEXT_STATE, GatedDeltaPlan

__all__ = ["tree_simple_gla_fla"]


def _import_chunk_simple_gla():
    try:
        from fla.ops.simple_gla import chunk_simple_gla
    except ImportError as error:  # pragma: no cover - depends on the machine
        raise ImportError("gated linear attention (Mamba-2) on the 'fla' backend needs flash-linear-attention >= 0.6 "
                          "and triton on a CUDA machine: pip install 'flash-linear-attention>=0.6,<0.7'") from error
    return chunk_simple_gla


def tree_simple_gla_fla(q, k, v, g, beta, plan: GatedDeltaPlan, *, scale: float,
                        initial_state: torch.Tensor | None = None, output_requested_states: bool = False):
    """Same contract as :func:`~.ops.tree_gated_delta_rule` with ``delta=False`` and ``g [U + R, HV]`` (rows: packed,
    then the plan's context rows; ``initial_state``: the state under :data:`CONTEXT_STATE`)."""
    fla_backend._check(q, plan)
    chunk_simple_gla = _import_chunk_simple_gla()
    U, HV, V = plan.num_tokens, v.shape[1], v.shape[2]
    HK, K = k.shape[1], k.shape[2]
    q, k = (x.repeat_interleave(HV // HK, dim=1) for x in (q, k))
    v = v * beta.unsqueeze(-1).to(v.dtype)
    zero = q.new_zeros(HV, K, V, dtype=torch.float32)
    states: dict = {} if initial_state is None else {CONTEXT_STATE: initial_state.float()}
    out_tokens, out_values = [], []
    for round_ in plan.rounds:
        round_ = fla_backend._on(round_, q.device)
        index = round_.token_index
        initial = torch.stack([zero if key is None else states[key] for key in round_.initial_state])
        o, final = chunk_simple_gla(q[index].unsqueeze(0), k[index].unsqueeze(0), v[index].unsqueeze(0),
                                    g=g[index].unsqueeze(0).float(), scale=scale, initial_state=initial,
                                    output_final_state=True, cu_seqlens=round_.cu_seqlens.long(),
                                    chunk_size=plan.chunk_size)
        for slot, _, key in round_.saved_states:
            states[key] = final[slot]
        out_tokens.append(round_.output_token)
        out_values.append(o[0, round_.output_position])
    out = v.new_zeros(U, HV, V).index_copy(0, torch.cat(out_tokens), torch.cat(out_values).to(v.dtype))
    if not output_requested_states:
        return out
    return out, [None if key is None else states[key] for key in plan.requested_states]
