"""The reference: fp32 log-softmax of the tempered logits, the chosen token's entry, and ``-sum(p log p)``."""

from __future__ import annotations

import torch


def logprob_entropy_reference(logits: torch.Tensor, labels: torch.Tensor,
                              temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [N, V]`` (any float dtype), ``labels [N]`` long -> fp32 ``logprobs [N]``, ``entropies [N]``."""
    log_probs = (logits.float() / temperature).log_softmax(-1)
    picked = log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return picked, -(log_probs.exp() * log_probs).sum(-1)
