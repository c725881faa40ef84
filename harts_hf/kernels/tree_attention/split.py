"""Tree attention as two dense calls per run, merged by log-sum-exp: cuDNN's attention on the GPU.

A run (see :mod:`.varlen`) attends to its ancestors without a mask and to itself causally. The first is a
``[q_len, ancestors]`` block, the second a square causal block, where top-left and bottom-right alignment agree;
neither needs the bottom-right causal mask that torch's cuDNN attention lacks. The two partial results merge as

    lse = logaddexp(lse_self, lse_anc);   out = out_self * exp(lse_self - lse) + out_anc * exp(lse_anc - lse)

and the backward of each block, given the MERGED ``out`` and ``lse``, is exactly that block's share of the whole
softmax's gradient (``P = exp(s - lse)`` is then the whole row's probability and ``D = rowsum(dO * out)`` the whole
row's): ``dq`` is the sum of the two, ``dk``/``dv`` land on the run's own rows and on its gathered ancestors.

On the H200 cuDNN's attention (SDPA's default there) runs ~1.6x the flash varlen kernel's pairs per second at head
dim 256 (``benchmarks/attention_kernels.py``). Each run is its own pair of calls, and cuDNN builds an execution plan
per new shape (~60 ms), so this pays off for long runs whose shapes repeat; many short runs stay on flash varlen
(see ``ops.CUDNN_MIN_PAIRS_PER_RUN``).

``primitive="math"`` runs the same decomposition with explicit softmax blocks (any device, fp32/fp64): the CPU
tests check the decomposition and the merged-statistics backward with it.
"""

from __future__ import annotations

import torch

__all__ = ["RunBlocks", "run_blocks", "tree_attention_split"]


class RunBlocks:
    """Host bounds of each run's queries and device indices of its ancestor keys (built once per layout)."""

    def __init__(self, bounds: list[tuple[int, int]], ancestors: list[torch.Tensor | None], pairs: float):
        self.bounds, self.ancestors, self.pairs = bounds, ancestors, pairs

    def __len__(self) -> int:
        return len(self.bounds)


def run_blocks(layout) -> RunBlocks:
    """Split a :class:`VarlenLayout`'s key paths into (own run, ancestors) per run (cached on the layout)."""
    cached = getattr(layout, "_run_blocks", None)
    if cached is not None:
        return cached
    cu_q, cu_k = layout.host_cu()
    bounds, ancestors, pairs = [], [], 0.0
    for r in range(len(cu_q) - 1):
        start, end = cu_q[r], cu_q[r + 1]
        length = end - start
        before = cu_k[r + 1] - cu_k[r] - length  # the path's ancestors, then the run's own rows
        bounds.append((start, end))
        ancestors.append(layout.key_index[cu_k[r]:cu_k[r] + before] if before else None)
        pairs += length * (length + 1) / 2 + length * before
    layout._run_blocks = RunBlocks(bounds, ancestors, pairs)
    return layout._run_blocks


# --- the two block primitives: (out, lse) forward and (dq, dk, dv) backward given out/lse -------------------------
# Tensors are [1, H, L, D] views of packed [L, H, D] rows; lse is float32 [1, HQ, Lq, 1].

def _expand(k: torch.Tensor, groups: int) -> torch.Tensor:
    return k if groups == 1 else k.repeat_interleave(groups, dim=1)


def _fold(dk: torch.Tensor, groups: int) -> torch.Tensor:
    return dk if groups == 1 else dk.unflatten(1, (-1, groups)).sum(2)


def _acc(dtype: torch.dtype) -> torch.dtype:
    """Statistics and merges in fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _math_forward(q, k, v, causal: bool, scale: float):
    groups = q.shape[1] // k.shape[1]
    k, v = _expand(k, groups), _expand(v, groups)
    scores = (q @ k.transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(~torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril(),
                                    float("-inf"))
    lse = torch.logsumexp(scores.to(_acc(q.dtype)), dim=-1, keepdim=True)
    return ((scores - lse).exp().to(v.dtype) @ v), lse


def _math_backward(grad, q, k, v, out, lse, causal: bool, scale: float):
    groups = q.shape[1] // k.shape[1]
    ke, ve = _expand(k, groups), _expand(v, groups)
    scores = (q @ ke.transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(~torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril(),
                                    float("-inf"))
    p = (scores - lse).exp().to(q.dtype)
    dv = p.transpose(-1, -2) @ grad
    dp = grad @ ve.transpose(-1, -2)
    ds = p * (dp - (grad * out).sum(-1, keepdim=True)) * scale
    return ds @ ke, _fold(ds.transpose(-1, -2) @ q, groups), _fold(dv, groups)


_CUDNN_GQA: bool | None = None  # whether cuDNN takes fewer KV heads as they are (found on first use)


def _cudnn_call(function, q, k, v, *args, **kwargs):
    """Call a cuDNN attention op with grouped KV heads as they are, or repeated where this build refuses them."""
    global _CUDNN_GQA
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and _CUDNN_GQA is not False:
        try:
            result = function(q, k, v, *args, **kwargs)
            _CUDNN_GQA = True
            return result, 1
        except RuntimeError:
            if _CUDNN_GQA:
                raise
            _CUDNN_GQA = False
    return function(q, _expand(k, groups), _expand(v, groups), *args, **kwargs), groups


def _cudnn_forward(q, k, v, causal: bool, scale: float):
    global _CUDNN_LSE_NDIM
    result, _ = _cudnn_call(torch.ops.aten._scaled_dot_product_cudnn_attention, q, k, v, None, True, 0.0, causal,
                            False, scale=scale)
    _CUDNN_LSE_NDIM = result[1].dim()
    return result[0], result[1].reshape(*q.shape[:3], 1).float()


_CUDNN_LSE_NDIM = 4  # cuDNN's own lse shape ([B, H, Lq, 1] or [B, H, Lq]), restored for its backward


def _cudnn_backward(grad, q, k, v, out, lse, causal: bool, scale: float):
    groups = 1 if _CUDNN_GQA else q.shape[1] // k.shape[1]
    k, v = _expand(k, groups), _expand(v, groups)
    seed = offset = q.new_zeros((), dtype=torch.int64)  # no dropout
    lse = lse.contiguous() if _CUDNN_LSE_NDIM == 4 else lse.squeeze(-1).contiguous()
    # no bias, and no cumulative sequence lengths (None: defined ones would make cuDNN expect nested [T, H, D])
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        grad, q, k, v, out, lse, seed, offset, None, None, None, q.shape[2], k.shape[2], 0.0, causal, scale=scale)
    return dq, _fold(dk, groups), _fold(dv, groups)


_PRIMITIVES = {"math": (_math_forward, _math_backward), "cudnn": (_cudnn_forward, _cudnn_backward)}


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1).unsqueeze(0)  # [L, H, D] -> [1, H, L, D] (a view)


def _merge(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    acc = _acc(out_a.dtype)
    out = out_a.to(acc) * (lse_a - lse).exp() + out_b.to(acc) * (lse_b - lse).exp()
    return out.to(out_a.dtype), lse


class _TreeAttentionSplit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, blocks: RunBlocks, scale: float, primitive: str):
        forward_block = _PRIMITIVES[primitive][0]
        out = torch.empty_like(q)
        lses = []
        for (start, end), ancestors in zip(blocks.bounds, blocks.ancestors):
            qr = _heads_first(q[start:end])
            o, lse = forward_block(qr, _heads_first(k[start:end]), _heads_first(v[start:end]), True, scale)
            if ancestors is not None:
                oa, lsea = forward_block(qr, _heads_first(k[ancestors]), _heads_first(v[ancestors]), False, scale)
                o, lse = _merge(o, lse, oa, lsea)
            out[start:end] = o[0].transpose(0, 1)
            lses.append(lse)
        ctx.save_for_backward(q, k, v, out, *lses)
        ctx.blocks, ctx.scale, ctx.primitive = blocks, scale, primitive
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, *lses = ctx.saved_tensors
        backward_block = _PRIMITIVES[ctx.primitive][1]
        grad = grad.contiguous()
        dq = torch.empty_like(q)
        acc = _acc(k.dtype)
        dk = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        for ((start, end), ancestors), lse in zip(zip(ctx.blocks.bounds, ctx.blocks.ancestors), lses):
            qr, gr, outr = (_heads_first(x[start:end]) for x in (q, grad, out))
            dqr, dkr, dvr = backward_block(gr, qr, _heads_first(k[start:end]), _heads_first(v[start:end]), outr,
                                           lse, True, ctx.scale)
            dk[start:end] += dkr[0].transpose(0, 1)
            dv[start:end] += dvr[0].transpose(0, 1)
            if ancestors is not None:
                dqa, dka, dva = backward_block(gr, qr, _heads_first(k[ancestors]), _heads_first(v[ancestors]), outr,
                                               lse, False, ctx.scale)
                dqr = dqr.to(acc) + dqa.to(acc)
                dk.index_add_(0, ancestors, dka[0].transpose(0, 1).to(acc))
                dv.index_add_(0, ancestors, dva[0].transpose(0, 1).to(acc))
            dq[start:end] = dqr[0].transpose(0, 1)
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None, None


def tree_attention_split(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: RunBlocks,
                         scaling: float | None = None, primitive: str = "cudnn") -> torch.Tensor:
    """q ``[U, HQ, D]``, k/v ``[U + C, HKV, D]`` (context rows last) -> ``[U, HQ, D]``; ``blocks`` from
    :func:`run_blocks`. ``primitive``: ``"cudnn"`` (CUDA, half precision) or ``"math"`` (explicit softmax)."""
    if primitive not in _PRIMITIVES:
        raise ValueError(f"tree_attention_split: primitive must be one of {tuple(_PRIMITIVES)}, got {primitive!r}")
    scale = q.shape[-1] ** -0.5 if scaling is None else scaling
    return _TreeAttentionSplit.apply(q, k, v, blocks, scale, primitive)
