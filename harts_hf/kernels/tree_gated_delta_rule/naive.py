"""Reference: expand the forest into its paths and run the plain gated delta rule on each path."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...trees import PackedForest
from .chunked import chunk_gated_delta_rule_torch, prepare_inputs

__all__ = ["gated_delta_rule_chunked", "gated_delta_rule_recurrent", "tree_gated_delta_rule_reference"]


def gated_delta_rule_recurrent(q, k, v, g, beta, *, scale=None, use_qk_l2norm_in_kernel=False,
                               delta: bool = True) -> torch.Tensor:
    """One sequence, one token at a time: ``S = exp(g) S; S += k (beta (v - S^T k))^T; o = S^T q``.

    q, k ``[L, HK, K]``; v ``[L, HV, V]``; beta ``[L, HV]``; g ``[L, HV]`` (one decay per head) or ``[L, HV, K]``
    (one per key channel: each row of ``S`` decays by its own factor, Kimi Delta Attention). ``delta=False``:
    ``S += k (beta v)^T`` without the ``- S^T k`` correction (gated linear attention, Mamba-2). Returns ``[L, HV, V]``
    in ``q.dtype``.
    """
    dtype = q.dtype
    q, k, v, g, beta = prepare_inputs(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    L, H, K = k.shape
    state = q.new_zeros(H, K, v.shape[-1])
    outputs = []
    for t in range(L):
        state = state * (g[t].exp()[:, :, None] if g.dim() == 3 else g[t].exp()[:, None, None])
        write = v[t] - torch.einsum("hkv,hk->hv", state, k[t]) if delta else v[t]
        state = state + k[t][:, :, None] * (write * beta[t][:, None])[:, None, :]
        outputs.append(torch.einsum("hkv,hk->hv", state, q[t]))
    return torch.stack(outputs).to(dtype)


def gated_delta_rule_chunked(q, k, v, g, beta, *, scale=None, use_qk_l2norm_in_kernel=False,
                             chunk_size: int = 64, delta: bool = True) -> torch.Tensor:
    """One sequence in chunked form from a zero state (padded at the end to whole chunks); shapes as
    :func:`gated_delta_rule_recurrent`. Keeps fp64 inputs in fp64."""
    q_, k_, v_, g_, beta_ = prepare_inputs(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    L = q_.shape[0]
    pad = (-L) % chunk_size
    q_, k_, v_ = (F.pad(x, (0, 0, 0, 0, 0, pad)).transpose(0, 1).unsqueeze(0) for x in (q_, k_, v_))
    g_, beta_ = (F.pad(x, (0, 0) * (x.dim() - 1) + (0, pad)).transpose(0, 1).unsqueeze(0) for x in (g_, beta_))
    state = q_.new_zeros(1, q_.shape[1], q_.shape[-1], v_.shape[-1])
    o, _ = chunk_gated_delta_rule_torch(q_, k_, v_, g_, beta_, state, chunk_size, delta=delta)
    return o[0].transpose(0, 1)[:L].to(q.dtype)


def tree_gated_delta_rule_reference(q, k, v, g, beta, packed: PackedForest, *, scale=None,
                                    use_qk_l2norm_in_kernel=False, chunk_size: int = 64,
                                    recurrent: bool = False, delta: bool = True) -> list[torch.Tensor]:
    """Per-path outputs ``[L_i, HV, V]``: each path gathered and run alone from a zero state.

    ``recurrent=True`` runs the token-by-token recurrence instead of the chunked form.
    """
    outputs = []
    for i in range(packed.num_sequences):
        index = packed.sequence_index(i).to(q.device)
        path = [x[index] for x in (q, k, v, g, beta)]
        if recurrent:
            outputs.append(gated_delta_rule_recurrent(*path, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                                      delta=delta))
        else:
            outputs.append(gated_delta_rule_chunked(*path, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                                    chunk_size=chunk_size, delta=delta))
    return outputs
