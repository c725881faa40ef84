"""Reference: causal attention run on every path of the forest."""

from __future__ import annotations

import torch

from ...trees import PackedForest

__all__ = ["causal_attention_reference", "explicit_attention", "tree_attention_reference"]


def explicit_attention(q, k, v, visible, scaling=None, softcap: float | None = None,
                       sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention written out: q ``[Q, HQ, D]``, k/v ``[K, HKV, D]``, ``visible [Q, K]`` bool -> ``[Q, HQ,
    D]`` (fp32 accumulation at least). ``softcap``: scores become ``c * tanh(s / c)`` before the mask (Gemma 2);
    ``sinks [HQ]``: one extra logit per head in every softmax, with a zero value (GPT-OSS), as transformers' eager
    attention computes them."""
    HQ = q.shape[1]
    compute = torch.promote_types(q.dtype, torch.float32)
    k = k.repeat_interleave(HQ // k.shape[1], dim=1).to(compute)
    v = v.repeat_interleave(HQ // v.shape[1], dim=1).to(compute)
    scores = torch.einsum("qhd,khd->hqk", q.to(compute), k) * (q.shape[-1] ** -0.5 if scaling is None else scaling)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.to(compute)[:, None, None].expand(-1, scores.shape[1], 1)], dim=-1)
    weights = scores.softmax(-1)[..., :visible.shape[1]]
    return torch.einsum("hqk,khd->qhd", weights, v).to(q.dtype)


def causal_attention_reference(q, k, v, scaling=None, window: int | None = None, softcap: float | None = None,
                               sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One sequence: q ``[L, HQ, D]``, k, v ``[L, HKV, D]`` -> ``[L, HQ, D]``, causal (explicit softmax).
    ``window``: a query sees the keys less than ``window`` positions before it (sliding-window attention);
    ``softcap`` and ``sinks`` as in :func:`explicit_attention`."""
    L = q.shape[0]
    causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    if window is not None:
        causal &= ~torch.ones(L, L, dtype=torch.bool, device=q.device).tril(-window)
    return explicit_attention(q, k, v, causal, scaling, softcap, sinks)


def tree_attention_reference(q, k, v, packed: PackedForest, scaling=None, window: int | None = None,
                             softcap: float | None = None, sinks: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Per-path outputs ``[L_i, HQ, D]``."""
    outputs = []
    for i in range(packed.num_sequences):
        index = packed.sequence_index(i).to(q.device)
        outputs.append(causal_attention_reference(q[index], k[index], v[index], scaling, window, softcap, sinks))
    return outputs
