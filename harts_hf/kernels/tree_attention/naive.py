"""Reference: causal attention run on every path of the forest."""

from __future__ import annotations

import torch

from ...trees import PackedForest

__all__ = ["causal_attention_reference", "tree_attention_reference"]


def causal_attention_reference(q, k, v, scaling=None, window: int | None = None, softcap: float | None = None,
                               sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One sequence: q ``[L, HQ, D]``, k, v ``[L, HKV, D]`` -> ``[L, HQ, D]`` (explicit softmax, fp32 accumulation).
    ``window``: a query sees the keys less than ``window`` positions before it (sliding-window attention);
    ``softcap``: ``c * tanh(scores / c)``; ``sinks [HQ]``: one extra zero-value logit per head."""
    L, HQ, D = q.shape
    repeat = HQ // k.shape[1]
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    scaling = D ** -0.5 if scaling is None else scaling
    compute = torch.promote_types(q.dtype, torch.float32)
    scores = torch.einsum("qhd,khd->hqk", q.to(compute), k.to(compute)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    if window is not None:
        causal &= ~torch.ones(L, L, dtype=torch.bool, device=q.device).tril(-window)
    scores = scores.masked_fill(~causal, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.to(compute)[:, None, None].expand(-1, L, 1)], dim=-1)
    weights = scores.softmax(-1)[..., :L]
    return torch.einsum("hqk,khd->qhd", weights, v.to(compute)).to(q.dtype)


def tree_attention_reference(q, k, v, packed: PackedForest, scaling=None, window: int | None = None,
                             softcap: float | None = None, sinks: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Per-path outputs ``[L_i, HQ, D]``."""
    outputs = []
    for i in range(packed.num_sequences):
        index = packed.sequence_index(i).to(q.device)
        outputs.append(causal_attention_reference(q[index], k[index], v[index], scaling, window, softcap, sinks))
    return outputs
