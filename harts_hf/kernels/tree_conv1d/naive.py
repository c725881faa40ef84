"""Reference: the plain depthwise causal conv1d run on every path of the forest."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...trees import PackedForest
from .ops import _activate

__all__ = ["causal_conv1d_reference", "tree_causal_conv1d_reference"]


def causal_conv1d_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                            activation: str | None = None) -> torch.Tensor:
    """One sequence ``x [L, C]``, ``weight [C, W]``: left-padded depthwise convolution, ``[L, C]``."""
    L, C = x.shape
    W = weight.shape[1]
    y = F.conv1d(x.t().unsqueeze(0).to(weight.dtype), weight.unsqueeze(1), bias, padding=W - 1, groups=C)[0, :, :L]
    return _activate(y, activation).t().to(x.dtype)


def tree_causal_conv1d_reference(x, weight, bias, packed: PackedForest, activation=None) -> list[torch.Tensor]:
    """Per-path outputs ``[L_i, C]``."""
    return [causal_conv1d_reference(x[packed.sequence_index(i).to(x.device)], weight, bias, activation)
            for i in range(packed.num_sequences)]
