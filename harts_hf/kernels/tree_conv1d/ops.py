"""Tree causal conv1d: each token convolves its own ancestor window (itself, parent, grandparent, ...).

``y[t] = act(b + sum_j w[:, W-1-j] * x[anc_j(t)])`` with ``anc_0(t) = t``, ``anc_{j+1}(t) = parent[anc_j(t)]``
and zeros past a root. In the packed DFS order a token's ancestors are the tokens just before it, except for the
first ``W - 1`` tokens of a run (a run continues its parent's chain; a new one starts below a branch point or at a
root): the convolution is ``W`` shifted multiply-adds over the packed rows (no ``[U, W, C]`` gather), and only
those few rows are recomputed from the ancestor table ``[U, W]``. A forest cut out below a branch point (a planner
piece) reads its root's ancestors from ``context`` rows instead of zeros.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

__all__ = ["BULK_BACKEND", "bulk_backend", "conv_window_fixups", "tree_causal_conv1d"]

BULK_BACKEND = "auto"
"""What the model's tree conv uses for the bulk (every row as if the packed rows were one sequence) on CUDA:
``"torch"`` (W shifted multiply-adds), ``"fla"`` (fla's fused ``causal_conv1d`` Triton kernel, one launch each
way) or ``"auto"``: fla where it imports. Measured on the H200 (bf16, 8,192 channels, fwd+bwd): fla 3.0 ms vs
shifted 5.0 ms on 8.4k rows, 106 vs 231 ms on 432k rows. CPU tensors always take ``"torch"``."""


@functools.cache
def _fla_conv_importable() -> bool:
    try:
        from fla.modules.causal_conv1d import causal_conv1d  # noqa: F401
    except ImportError:
        return False
    return True


def bulk_backend(x: torch.Tensor, choice: str | None = None) -> str:
    """The bulk implementation for ``x``: ``"torch"`` on CPU; on CUDA ``choice`` (default :data:`BULK_BACKEND`),
    where ``"auto"`` is ``"fla"`` when fla's conv imports and ``"torch"`` otherwise."""
    choice = BULK_BACKEND if choice is None else choice
    if choice not in ("auto", "torch", "fla"):
        raise ValueError(f"tree conv1d: BULK_BACKEND must be 'auto', 'torch' or 'fla', got {choice!r}")
    if not x.is_cuda:
        return "torch"
    if choice == "auto":
        return "fla" if _fla_conv_importable() else "torch"
    return choice


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    return y if activation is None else F.silu(y)  # "silu" / "swish", checked by tree_causal_conv1d


def conv_window_fixups(ancestors: torch.Tensor, width: int) -> torch.Tensor:
    """``[F]`` long: the rows whose ancestor window (``ancestors[:, :width]``) is not the ``width`` packed rows
    ending at them (zeros before row 0): the first ``width - 1`` tokens of every run, where the window reaches a
    parent elsewhere, context rows or zeros past a root. Syncs with the device (``nonzero``): cache it per forest."""
    U = ancestors.shape[0]
    before = torch.arange(U, device=ancestors.device)[:, None] - torch.arange(width, device=ancestors.device)
    return torch.nonzero((ancestors[:, :width] != before.clamp(min=-1)).any(1)).squeeze(1)


def tree_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ancestors: torch.Tensor,
                       activation: str | None = None, context: torch.Tensor | None = None,
                       fixups: torch.Tensor | None = None, backend: str = "torch") -> torch.Tensor:
    """Depthwise causal convolution along every path of a packed forest.

    Args:
        x: ``[U, C]`` packed inputs. weight: ``[C, W]`` (``W`` taps, the last one multiplies the token itself).
        bias: ``[C]`` or None. ancestors: ``[U, >= W]`` long, column j = j-th ancestor, -1 past a root
            (``PackedForest.ancestor_table(W)``); entries ``U + i`` read ``context[i]``. activation: None or ``"silu"``.
        context: ``[M, C]`` inputs of ancestors outside the forest (``M <= W - 1``, oldest first), or None.
        fixups: :func:`conv_window_fixups` of ``ancestors`` (computed here if None).
        backend: the bulk's implementation, ``"torch"`` or ``"fla"`` (CUDA; see :data:`BULK_BACKEND`).

    Returns:
        ``[U, C]`` in ``x.dtype``; computed in the promoted dtype of ``x`` and ``weight`` (fp32 for bf16 inputs and
        fp32 weights, as under autocast with fp32 master weights) and rounded once. With ``"fla"`` the input gradient
        of the few rows inside fixup windows is rounded to ``x.dtype`` once for the bulk and once for the fixups.
    """
    U, C = x.shape
    W = weight.shape[1]
    if weight.shape[0] != C:
        raise ValueError(f"tree_causal_conv1d: weight has {weight.shape[0]} channels, x has {C}")
    if ancestors.shape[0] != U or ancestors.shape[1] < W:
        raise ValueError(f"tree_causal_conv1d: ancestors must be [U={U}, >= W={W}], got {tuple(ancestors.shape)}")
    if context is not None and (context.dim() != 2 or context.shape[1] != C):
        raise ValueError(f"tree_causal_conv1d: context must be [M, C={C}], got {tuple(context.shape)}")
    if backend not in ("torch", "fla"):
        raise ValueError(f"tree_causal_conv1d: backend must be 'torch' or 'fla', got {backend!r}")
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"tree_causal_conv1d: activation must be None, 'silu' or 'swish', got {activation!r}")
    compute = torch.promote_types(x.dtype, weight.dtype)  # fp32 for bf16 inputs and fp32 weights (autocast)
    taps = weight.flip(1).t()  # [W, C]: row j multiplies the j-th ancestor
    if backend == "fla":
        try:
            from fla.modules.causal_conv1d import causal_conv1d
        except ImportError as error:
            raise ImportError("tree_causal_conv1d: backend='fla' needs flash-linear-attention and triton: pip install "
                              "'flash-linear-attention>=0.6,<0.7' triton (or use backend='torch')") from error

        # fla's kernel reads x, weight and bias in their own dtypes and computes in fp32; y and dx are rounded once
        # to x's dtype (no fp32 copy of x or y)
        y = causal_conv1d(x.unsqueeze(0), weight.to(compute), None if bias is None else bias.to(compute),
                          activation=activation)[0].squeeze(0)
        rows = x
    else:
        # in the promoted dtype before anything else: the W terms' input gradients then add up in fp32 and round
        # once (promoting inside each product rounds each term's gradient)
        rows = x.to(compute)
        shifted = F.pad(rows, (0, 0, W - 1, 0))  # row W - 1 + t is token t; zeros above
        y = taps[0] * rows
        for j in range(1, W):
            y = y + taps[j] * shifted[W - 1 - j: W - 1 - j + U]
        y = _activate(y if bias is None else y + bias, activation)
    if fixups is None:
        fixups = conv_window_fixups(ancestors, W)
    if fixups.numel():
        index = ancestors[fixups, :W]  # [F, W]
        window = rows[index.clamp(0, U - 1)].to(compute) * ((index >= 0) & (index < U)).unsqueeze(-1).to(compute)
        if context is not None and context.shape[0]:
            inside = context.to(compute)[(index - U).clamp(0, context.shape[0] - 1)]
            window = window + inside * (index >= U).unsqueeze(-1).to(compute)
        fixed = (window * taps).sum(1)
        y = y.index_put((fixups,), _activate(fixed if bias is None else fixed + bias, activation).to(y.dtype))
    return y.to(x.dtype)
