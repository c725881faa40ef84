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

Shape buckets (``run_blocks(layout, key_block=K)``): cuDNN builds an execution plan for every new block shape (~60
ms), and every training step brings new forests. With ``key_block`` the shapes come from a small fixed set: a run's
ancestors go in unmasked blocks of exactly ``K`` keys, the ``A mod K`` nearest ones join the causal block (as
leading rows whose queries are zero and whose outputs are dropped), and every block's rows are rounded up
(:func:`bucket_rows`) with zero rows at the end: padded or dropped query rows get zero output gradient and a huge
log-sum-exp, so they contribute nothing, and padded keys sit after every real query of the causal block.

``primitive="math"`` runs the same decomposition with explicit softmax blocks (any device, fp32/fp64): the CPU
tests check the decomposition and the merged-statistics backward with it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["RunBlocks", "bucket_rows", "run_blocks", "tree_attention_split"]


class _Run(NamedTuple):
    """One run's blocks: its query rows ``start .. end`` (host), its ancestors in unmasked key blocks (``chunks``,
    device indices), the ancestors joining its causal block (``tail`` or None), and the rows the unmasked blocks'
    queries and the causal block are padded to."""

    start: int
    end: int
    chunks: list[torch.Tensor]
    tail: torch.Tensor | None
    query_rows: int
    self_rows: int


class RunBlocks:
    """Every run's :class:`_Run` and the attended pairs in all; built once per layout."""

    def __init__(self, runs: list[_Run], pairs: float):
        self.runs, self.pairs = runs, pairs

    def __len__(self) -> int:
        return len(self.runs)

    def shapes(self) -> set[tuple[int, int, bool]]:
        """The distinct (query rows, key rows, causal) block shapes: what cuDNN builds a plan for."""
        found = set()
        for run in self.runs:
            found.add((run.self_rows, run.self_rows, True))
            found.update((run.query_rows, int(chunk.numel()), False) for chunk in run.chunks)
        return found


def bucket_rows(rows: int, multiple: int) -> int:
    """Rows rounded up: to a power of two up to ``multiple``, to a multiple of ``multiple`` above it."""
    if rows <= multiple:
        return 1 << max(rows - 1, 0).bit_length()
    return -(-rows // multiple) * multiple


def run_blocks(layout, key_block: int | None = None, row_multiple: int = 1024) -> RunBlocks:
    """Split a :class:`VarlenLayout`'s key paths into (own run, ancestors) per run (cached on the layout per
    ``key_block``/``row_multiple``). ``key_block=None``: one unmasked block of all ancestors, exact shapes."""
    cache = layout.__dict__.setdefault("_run_blocks", {})
    if (key_block, row_multiple) in cache:
        return cache[key_block, row_multiple]
    cu_q, cu_k = layout.host_cu()
    runs, pairs = [], 0.0
    for r in range(len(cu_q) - 1):
        start, end = cu_q[r], cu_q[r + 1]
        length = end - start
        before = cu_k[r + 1] - cu_k[r] - length  # the path's ancestors, then the run's own rows
        ancestors = layout.key_index[cu_k[r]:cu_k[r] + before]
        pairs += length * (length + 1) / 2 + length * before
        if key_block is None:
            runs.append(_Run(start, end, [ancestors] if before else [], None, length, length))
            continue
        full = before // key_block * key_block
        chunks = list(ancestors[:full].split(key_block)) if full else []
        tail = ancestors[full:] if before > full else None
        runs.append(_Run(start, end, chunks, tail, bucket_rows(length, row_multiple),
                         bucket_rows(before - full + length, row_multiple)))
    cache[key_block, row_multiple] = RunBlocks(runs, pairs)
    return cache[key_block, row_multiple]


# --- the two block primitives: (out, lse) forward and (dq, dk, dv) backward given out/lse -------------------------
# Tensors are [1, H, L, D] views of packed [L, H, D] rows; lse is float32 [1, HQ, Lq, 1].

def _expand(k: torch.Tensor, groups: int) -> torch.Tensor:
    return k if groups == 1 else k.repeat_interleave(groups, dim=1)


def _fold(dk: torch.Tensor, groups: int) -> torch.Tensor:
    return dk if groups == 1 else dk.unflatten(1, (-1, groups)).sum(2)


def _acc(dtype: torch.dtype) -> torch.dtype:
    """Statistics and merges in fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _math_scores(q, k, causal: bool, scale: float) -> torch.Tensor:
    scores = (q @ k.transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(~torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril(),
                                    float("-inf"))
    return scores


def _math_forward(q, k, v, causal: bool, scale: float):
    groups = q.shape[1] // k.shape[1]
    scores = _math_scores(q, _expand(k, groups), causal, scale)
    lse = torch.logsumexp(scores.to(_acc(q.dtype)), dim=-1, keepdim=True)
    return ((scores - lse).exp().to(v.dtype) @ _expand(v, groups)), lse


def _math_backward(grad, q, k, v, out, lse, causal: bool, scale: float):
    groups = q.shape[1] // k.shape[1]
    ke, ve = _expand(k, groups), _expand(v, groups)
    p = (_math_scores(q, ke, causal, scale) - lse).exp().to(q.dtype)
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


_IGNORED_LSE = 1e30  # the log-sum-exp given to padded or dropped query rows: exp(score - lse) = 0 in the backward


def _rows(x: torch.Tensor, lead: torch.Tensor | int, rows: int) -> torch.Tensor:
    """``[lead ; x ; zeros]`` with ``rows`` rows in all (``lead``: leading rows, or how many zero rows); ``x``
    itself when nothing is added."""
    lead_rows = lead if isinstance(lead, int) else lead.shape[0]
    if lead_rows == 0 and rows == x.shape[0]:
        return x
    parts = [x.new_zeros(lead_rows, *x.shape[1:]) if isinstance(lead, int) else lead, x]
    if rows > lead_rows + x.shape[0]:
        parts.append(x.new_zeros(rows - lead_rows - x.shape[0], *x.shape[1:]))
    return torch.cat(parts)


def _own_rows(x: torch.Tensor, start: int, end: int, tail: torch.Tensor | None) -> torch.Tensor:
    """The causal block's key or value rows: the ``tail`` ancestors (if any), then the run's own rows."""
    return x[start:end] if tail is None else torch.cat([x[tail], x[start:end]])


def _padded_lse(lse: torch.Tensor, lead: int, rows: int) -> torch.Tensor:
    """``lse [1, H, n, 1]`` placed at rows ``lead .. lead + n`` of ``rows``, the others ignored."""
    if lead == 0 and rows == lse.shape[2]:
        return lse
    out = lse.new_full((1, lse.shape[1], rows, 1), _IGNORED_LSE)
    out[:, :, lead:lead + lse.shape[2]] = lse
    return out


class _TreeAttentionSplit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, blocks: RunBlocks, scale: float, primitive: str):
        forward_block = _PRIMITIVES[primitive][0]
        out = torch.empty_like(q)
        lses = []
        for start, end, chunks, tail, query_rows, self_rows in blocks.runs:
            n, lead = end - start, 0 if tail is None else tail.shape[0]
            keys, values = _own_rows(k, start, end, tail), _own_rows(v, start, end, tail)
            o, lse = forward_block(_heads_first(_rows(q[start:end], lead, self_rows)),
                                   _heads_first(_rows(keys, 0, self_rows)), _heads_first(_rows(values, 0, self_rows)),
                                   True, scale)
            o, lse = o[:, :, lead:lead + n], lse[:, :, lead:lead + n]
            queries = _heads_first(_rows(q[start:end], 0, query_rows))
            for chunk in chunks:
                oc, lsec = forward_block(queries, _heads_first(k[chunk]), _heads_first(v[chunk]), False, scale)
                o, lse = _merge(o, lse, oc[:, :, :n], lsec[:, :, :n])
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
        for (start, end, chunks, tail, query_rows, self_rows), lse in zip(ctx.blocks.runs, lses):
            n, lead = end - start, 0 if tail is None else tail.shape[0]
            keys, values = _own_rows(k, start, end, tail), _own_rows(v, start, end, tail)
            dqs, dks, dvs = backward_block(
                *(_heads_first(_rows(x[start:end], lead, self_rows)) for x in (grad, q)),
                _heads_first(_rows(keys, 0, self_rows)), _heads_first(_rows(values, 0, self_rows)),
                _heads_first(_rows(out[start:end], lead, self_rows)), _padded_lse(lse, lead, self_rows), True,
                ctx.scale)
            dqr = dqs[0, :, lead:lead + n].to(acc)
            dks, dvs = dks[0].transpose(0, 1).to(acc), dvs[0].transpose(0, 1).to(acc)
            dk[start:end] += dks[lead:lead + n]
            dv[start:end] += dvs[lead:lead + n]
            if lead:
                dk.index_add_(0, tail, dks[:lead])
                dv.index_add_(0, tail, dvs[:lead])
            if chunks:
                gr, qr, outr = (_heads_first(_rows(x[start:end], 0, query_rows)) for x in (grad, q, out))
                lser = _padded_lse(lse, 0, query_rows)
            for chunk in chunks:
                dqc, dkc, dvc = backward_block(gr, qr, _heads_first(k[chunk]), _heads_first(v[chunk]), outr, lser,
                                               False, ctx.scale)
                dqr += dqc[0, :, :n].to(acc)
                dk.index_add_(0, chunk, dkc[0].transpose(0, 1).to(acc))
                dv.index_add_(0, chunk, dvc[0].transpose(0, 1).to(acc))
            dq[start:end] = dqr.transpose(0, 1)
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None, None


def tree_attention_split(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: RunBlocks,
                         scaling: float | None = None, primitive: str = "cudnn") -> torch.Tensor:
    """q ``[U, HQ, D]``, k/v ``[U + C, HKV, D]`` (context rows last) -> ``[U, HQ, D]``; ``blocks`` from
    :func:`run_blocks`. ``primitive``: ``"cudnn"`` (CUDA, half precision) or ``"math"`` (explicit softmax)."""
    if primitive not in _PRIMITIVES:
        raise ValueError(f"tree_attention_split: primitive must be one of {tuple(_PRIMITIVES)}, got {primitive!r}")
    scale = q.shape[-1] ** -0.5 if scaling is None else scaling
    return _TreeAttentionSplit.apply(q, k, v, blocks, scale, primitive)
