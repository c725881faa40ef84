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
from .fla_kda import import_fla_op, per_round
from .plan import GatedDeltaPlan

__all__ = ["tree_simple_gla_fla"]


def tree_simple_gla_fla(q, k, v, g, beta, plan: GatedDeltaPlan, *, scale: float,
                        initial_state: torch.Tensor | None = None, output_requested_states: bool = False):
    """Same contract as :func:`~.ops.tree_gated_delta_rule` with ``delta=False`` and ``g [U + R, HV]`` (rows: packed,
    then the plan's context rows; ``initial_state``: the state under :data:`CONTEXT_STATE`)."""
    fla_backend._check(q, plan)
    chunk_simple_gla = import_fla_op("fla.ops.simple_gla", "chunk_simple_gla", "gated linear attention (Mamba-2)")
    HV = v.shape[1]
    q, k = (x.repeat_interleave(HV // k.shape[1], dim=1) for x in (q, k))

    def call(round_, inputs, initial):
        q_, k_, v_, g_ = inputs
        return chunk_simple_gla(q_, k_, v_, g=g_.float(), scale=scale, initial_state=initial, output_final_state=True,
                                cu_seqlens=round_.cu_seqlens.long(), chunk_size=plan.chunk_size)

    return per_round(call, (q, k, v * beta.unsqueeze(-1).to(v.dtype), g), plan, initial_state,
                     output_requested_states)
