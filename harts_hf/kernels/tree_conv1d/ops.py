"""Tree causal conv1d: each token convolves its own ancestor window (itself, parent, grandparent, ...).

``y[t] = act(b + sum_j w[:, W-1-j] * x[anc_j(t)])`` with ``anc_0(t) = t``, ``anc_{j+1}(t) = parent[anc_j(t)]``
and zeros past a root: one gather and a multiply-add over an ancestor table ``[U, W]``. A forest cut out below a
branch point (a planner piece) reads its root's ancestors from ``context`` rows instead of zeros.
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
                       activation: str | None = None, context: torch.Tensor | None = None) -> torch.Tensor:
    """Depthwise causal convolution along every path of a packed forest.

    Args:
        x: ``[U, C]`` packed inputs. weight: ``[C, W]`` (``W`` taps, the last one multiplies the token itself).
        bias: ``[C]`` or None. ancestors: ``[U, >= W]`` long, column j = j-th ancestor, -1 past a root
            (``PackedForest.ancestor_table(W)``); entries ``U + i`` read ``context[i]``. activation: None or ``"silu"``.
        context: ``[M, C]`` inputs of ancestors outside the forest (``M <= W - 1``, oldest first), or None.

    Returns:
        ``[U, C]`` in ``x.dtype``; computed in ``weight.dtype`` as ``torch.nn.functional.conv1d`` would.
    """
    U, C = x.shape
    W = weight.shape[1]
    if weight.shape[0] != C:
        raise ValueError(f"tree_causal_conv1d: weight has {weight.shape[0]} channels, x has {C}")
    if ancestors.shape[0] != U or ancestors.shape[1] < W:
        raise ValueError(f"tree_causal_conv1d: ancestors must be [U={U}, >= W={W}], got {tuple(ancestors.shape)}")
    rows = [x.to(weight.dtype)]
    if context is not None:
        if context.dim() != 2 or context.shape[1] != C:
            raise ValueError(f"tree_causal_conv1d: context must be [M, C={C}], got {tuple(context.shape)}")
        rows.append(context.to(weight.dtype))
    rows.append(x.new_zeros(1, C, dtype=weight.dtype))  # the last row is the zero past a root
    padded = torch.cat(rows)
    index = torch.where(ancestors[:, :W] >= 0, ancestors[:, :W], padded.shape[0] - 1)
    taps = weight.flip(1).t()  # [W, C]: row j multiplies the j-th ancestor
    y = (padded[index] * taps).sum(1)
    if bias is not None:
        y = y + bias
    return _activate(y, activation).to(x.dtype)
