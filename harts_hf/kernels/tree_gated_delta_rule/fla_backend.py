"""The ``"fla"`` backend: one fla ``chunk_gated_delta_rule`` varlen call per round (CUDA only).

The plan must be built with ``final_states_only=True``: fla returns only each sequence's final state, so
runs are cut at the chunk boundaries their children restart from.
"""

from __future__ import annotations

import torch

from .plan import GatedDeltaPlan


def _import_fla():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as error:  # pragma: no cover - depends on the machine
        raise ImportError("the 'fla' backend needs flash-linear-attention >= 0.6 and triton on a CUDA machine: "
                          "pip install 'flash-linear-attention>=0.6,<0.7'") from error
    return chunk_gated_delta_rule


def tree_gated_delta_rule_fla(q, k, v, g, beta, plan: GatedDeltaPlan, *, scale: float,
                              use_qk_l2norm_in_kernel: bool) -> torch.Tensor:
    """Same contract as :func:`tree_gated_delta_rule` (``[U, H, D]`` inputs on CUDA)."""
    if not q.is_cuda:
        raise ValueError("tree_gated_delta_rule_fla needs CUDA tensors; CPU tensors take the torch backend")
    if any(saved[1] is not None for round_ in plan.rounds for saved in round_.saved_states):
        raise ValueError("the fla backend needs a plan built with final_states_only=True")
    chunk_gated_delta_rule = _import_fla()
    U, HV, V = v.shape
    K = k.shape[-1]
    states: dict = {}
    out_tokens, out_values = [], []
    for round_ in plan.rounds:
        round_ = round_ if round_.token_index.device == q.device else round_.to(q.device)
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
