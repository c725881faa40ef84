"""Tree causal conv1d: each token convolves its own ancestor window (itself, parent, grandparent, ...).

``y[t] = act(b + sum_j w[:, W-1-j] * x[anc_j(t)])`` with ``anc_0(t) = t``, ``anc_{j+1}(t) = parent[anc_j(t)]``
and zeros past a root: one gather and a multiply-add over an ancestor table ``[U, W]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["tree_causal_conv1d"]


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return y
    if activation in ("silu", "swish"):
        return F.silu(y)
    raise ValueError(f"tree_causal_conv1d: activation must be None, 'silu' or 'swish', got {activation!r}")


def tree_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ancestors: torch.Tensor,
                       activation: str | None = None) -> torch.Tensor:
    """Depthwise causal convolution along every path of a packed forest.

    Args:
        x: ``[U, C]`` packed inputs. weight: ``[C, W]`` (``W`` taps, the last one multiplies the token itself).
        bias: ``[C]`` or None. ancestors: ``[U, >= W]`` long, column j = j-th ancestor, -1 past a root
            (``PackedForest.ancestor_table(W)``). activation: None or ``"silu"``.

    Returns:
        ``[U, C]`` in ``x.dtype``; computed in ``weight.dtype`` as ``torch.nn.functional.conv1d`` would.
    """
    U, C = x.shape
    W = weight.shape[1]
    if weight.shape[0] != C:
        raise ValueError(f"tree_causal_conv1d: weight has {weight.shape[0]} channels, x has {C}")
    if ancestors.shape[0] != U or ancestors.shape[1] < W:
        raise ValueError(f"tree_causal_conv1d: ancestors must be [U={U}, >= W={W}], got {tuple(ancestors.shape)}")
    padded = torch.cat([x.to(weight.dtype), x.new_zeros(1, C, dtype=weight.dtype)])  # row U is the zero past a root
    index = torch.where(ancestors[:, :W] >= 0, ancestors[:, :W], U)
    taps = weight.flip(1).t()  # [W, C]: row j multiplies the j-th ancestor
    y = (padded[index] * taps).sum(1)
    if bias is not None:
        y = y + bias
    return _activate(y, activation).to(x.dtype)
