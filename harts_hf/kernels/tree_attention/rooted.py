"""Tree attention with each tree's shared root attended in place: no gathered copies of it (CUDA: flash varlen).

The varlen layout (:mod:`.varlen`) gathers every run's root-to-run key path, so a tree's root segment is copied
once per run: on full-size `tau` (a 9,598-token prompt under 96 runs) most gathered key rows are copies of it, and
for MLA's wide heads (32 key heads of 192 and values padded to 192: 24.6 KB a row in bf16) the gathers and the
atomic scatter-add of their gradients cost about as much as the tree's extra attention pairs (BENCHMARKS.md, the
Kimi-Linear profile of 2026-12-06). Here every token below a tree's root segment (rows ``[a + L, E)`` in DFS order,
contiguous) attends the root's rows ``[a, a + L)`` (contiguous too) in one unmasked call on the rows as they are,
and the runs' remaining paths (without the root) go through one varlen call as before. Context rows (ancestors
outside the forest, the planner's hand-offs) are split off the same way: every query attends them unmasked. The
partial results merge through their log-sum-exps,

    lse = logaddexp(lse_rest, lse_root);   out = out_rest * exp(lse_rest - lse) + out_root * exp(lse_root - lse)

and each call's backward, given the merged ``out`` and ``lse``, is exactly its share of the whole softmax's
gradient (:mod:`.split` says why).

``primitive="math"`` runs the same decomposition with explicit softmax per sequence (any device, fp32/fp64): the
CPU tests check the split and the merged-statistics backward with it; ``"flash"`` calls FlashAttention-2 inside
torch (``aten._flash_attention_forward`` / ``_backward``, bottom-right causal, GQA as is). Opt-in
(:data:`.varlen.SPLIT_SHARED_ROOTS`) until it is measured on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .split import _acc

__all__ = ["RootSplit", "shared_root_split", "tree_attention_rooted"]

MIN_SAVED_ROWS = 1024
"""A tree's root is split off only where that saves at least this many gathered key rows (root rows x other runs);
context rows always are."""


@dataclass
class RootSplit:
    """``rest``: the runs' key paths without the split-off rows (a :class:`~.varlen.VarlenLayout` whose key index
    points into ``k``'s rows, context included); ``blocks``: ``(q_start, q_end, k_start, k_end)``, query rows that
    attend those key rows unmasked; ``saved_rows``: gathered key rows no longer gathered."""

    rest: object
    blocks: list[tuple[int, int, int, int]]
    saved_rows: int


def _leading_run(path: np.ndarray, start: int, limit: int) -> int:
    """How many leading entries of ``path`` are ``start, start + 1, ...`` (at most ``limit``)."""
    limit = min(limit, path.shape[0])
    same = path[:limit] == np.arange(start, start + limit)
    return limit if same.all() else int(np.argmin(same))


def shared_root_split(layout, min_saved_rows: int | None = None) -> RootSplit:
    """The split of ``layout`` (a :class:`~.varlen.VarlenLayout`), cached on it per ``min_saved_rows``."""
    from .varlen import VarlenLayout

    min_saved_rows = MIN_SAVED_ROWS if min_saved_rows is None else min_saved_rows
    cache = layout.__dict__.setdefault("_root_split", {})
    if min_saved_rows in cache:
        return cache[min_saved_rows]
    cu_q, cu_k = layout.host_cu()
    key_index = layout.key_index.cpu().numpy()
    U, C, runs = cu_q[-1], layout.context_tokens, len(cu_q) - 1
    paths = [key_index[cu_k[r] + C: cu_k[r + 1]] for r in range(runs)]  # context rows lead every path
    blocks = [(0, U, U, U + C)] if C else []
    saved = C * runs
    roots = [r for r in range(runs) if paths[r].shape[0] == cu_q[r + 1] - cu_q[r]] + [runs]
    rows, new_paths = [], []
    for r0, r1 in zip(roots, roots[1:]):  # the runs of one tree: its root run, then the others (DFS order)
        a, e0 = cu_q[r0], cu_q[r0 + 1]
        shared = min((_leading_run(paths[r], a, e0 - a) for r in range(r0 + 1, r1)), default=0)
        if shared == 0 or shared * (r1 - r0 - 1) < min_saved_rows:
            rows.extend(cu_q[r + 1] - cu_q[r] for r in range(r0, r1))
            new_paths.extend(paths[r0:r1])
            continue
        blocks.append((a + shared, cu_q[r1], a, a + shared))
        saved += shared * (r1 - r0 - 1)
        rows.append(shared)  # the root run's first rows: their own keys, causal
        new_paths.append(paths[r0][:shared])
        if e0 > a + shared:
            rows.append(e0 - a - shared)
            new_paths.append(paths[r0][shared:])
        rows.extend(cu_q[r + 1] - cu_q[r] for r in range(r0 + 1, r1))
        new_paths.extend(path[shared:] for path in paths[r0 + 1: r1])
    lengths_k = np.fromiter((p.shape[0] for p in new_paths), dtype=np.int64, count=len(new_paths))
    new_cu_q = np.zeros(len(rows) + 1, dtype=np.int32)
    new_cu_k = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum(rows, out=new_cu_q[1:])
    np.cumsum(lengths_k, out=new_cu_k[1:])
    device = layout.key_index.device
    rest = VarlenLayout(torch.from_numpy(np.concatenate(new_paths).astype(np.int64)).to(device),
                        torch.from_numpy(new_cu_q).to(device), torch.from_numpy(new_cu_k).to(device),
                        int(max(rows)), int(lengths_k.max()), 0, (new_cu_q.tolist(), new_cu_k.tolist()))
    cache[min_saved_rows] = RootSplit(rest, blocks, saved)
    return cache[min_saved_rows]


# --- primitives on packed rows: q [Tq, HQ, D], k/v [Tk, HKV, D]; lse float32 [HQ, Tq] ------------------------------

def _math_scores(q, k, causal: bool, scale: float) -> torch.Tensor:
    groups = q.shape[1] // k.shape[1]
    scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(groups, dim=1)) * scale
    if causal:  # bottom-right: query i sees keys up to i + (Lk - Lq)
        visible = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril(k.shape[0] - q.shape[0])
        scores = scores.masked_fill(~visible, float("-inf"))
    return scores


def _math_forward(q, k, v, cu_q, cu_k, causal: bool, scale: float):
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    lse = torch.empty(q.shape[1], q.shape[0], dtype=_acc(q.dtype), device=q.device)
    groups = q.shape[1] // k.shape[1]
    for i in range(len(cu_q) - 1):
        rq, rk = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        scores = _math_scores(q[rq], k[rk], causal, scale).to(lse.dtype)
        lse[:, rq] = torch.logsumexp(scores, dim=-1)
        weights = (scores - lse[:, rq, None]).exp().to(v.dtype)
        out[rq] = torch.einsum("hqk,khd->qhd", weights, v[rk].repeat_interleave(groups, dim=1))
    return out, lse


def _math_backward(grad, q, k, v, out, lse, cu_q, cu_k, causal: bool, scale: float):
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    groups = q.shape[1] // k.shape[1]
    for i in range(len(cu_q) - 1):
        rq, rk = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        ke, ve = (x[rk].repeat_interleave(groups, dim=1) for x in (k, v))
        p = (_math_scores(q[rq], k[rk], causal, scale).to(lse.dtype) - lse[:, rq, None]).exp().to(q.dtype)
        dp = torch.einsum("qhd,khd->hqk", grad[rq], ve)
        ds = p * (dp - (grad[rq] * out[rq]).sum(-1).transpose(0, 1)[..., None]) * scale
        dq[rq] = torch.einsum("hqk,khd->qhd", ds, ke)
        dk[rk] = torch.einsum("hqk,qhd->khd", ds, q[rq]).unflatten(1, (-1, groups)).sum(2)
        dv[rk] = torch.einsum("hqk,qhd->khd", p, grad[rq]).unflatten(1, (-1, groups)).sum(2)
    return dq, dk, dv


def _flash_window(causal: bool) -> dict:
    return dict(window_size_left=-1, window_size_right=0 if causal else -1)


def _flash_forward(q, k, v, cu_q, cu_k, causal: bool, scale: float):
    lengths_q, lengths_k = cu_q.diff(), cu_k.diff()
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, int(lengths_q.max()), int(lengths_k.max()), 0.0, causal, False, scale=scale,
        **_flash_window(causal))
    if lse.shape != (q.shape[1], q.shape[0]):
        raise RuntimeError(f"tree attention (rooted): flash varlen returned a log-sum-exp of shape {tuple(lse.shape)}, "
                           f"expected (heads, rows) = {(q.shape[1], q.shape[0])}; set varlen.SPLIT_SHARED_ROOTS = False")
    return out, lse


def _flash_backward(grad, q, k, v, out, lse, cu_q, cu_k, causal: bool, scale: float):
    lengths_q, lengths_k = cu_q.diff(), cu_k.diff()
    rng = torch.zeros(2, dtype=torch.uint64, device=q.device)  # no dropout
    return torch.ops.aten._flash_attention_backward(
        grad, q, k, v, out, lse, cu_q, cu_k, int(lengths_q.max()), int(lengths_k.max()), 0.0, causal, rng,
        torch.empty(0, device=q.device), scale=scale, **_flash_window(causal))


_PRIMITIVES = {"math": (_math_forward, _math_backward), "flash": (_flash_forward, _flash_backward)}


def _block_rows(split: RootSplit, q_row_elements: int, k_row_elements: int,
                limit: int) -> list[tuple[int, int, int, int]]:
    """The unmasked blocks with their query rows cut so that one call stays under ``limit`` elements."""
    from .varlen import PAD_ROWS

    for _, _, k_start, k_end in split.blocks:
        if (k_end - k_start + PAD_ROWS) * k_row_elements > limit:
            raise ValueError(f"tree attention: a shared root of {k_end - k_start} rows is more than one flash varlen "
                             f"call can address ({limit} elements per tensor); split the forest into pieces "
                             "(TreeGRPOConfig.tree_token_budget / harts_hf.planner.plan(token_budget=...))")
    step = max(limit // q_row_elements - PAD_ROWS, 1)
    return [(start, min(start + step, q_end), k_start, k_end) for q_start, q_end, k_start, k_end in split.blocks
            for start in range(q_start, q_end, step)]


def _merge_into(out, lse, rows: slice, out_b, lse_b):
    """``out[rows]`` / ``lse[:, rows]`` merged with a block's partial result (in fp32, rounded once)."""
    merged = torch.logaddexp(lse[:, rows], lse_b)
    acc = _acc(out.dtype)
    mine, theirs = ((x - merged).exp().transpose(0, 1)[..., None] for x in (lse[:, rows], lse_b))
    out[rows] = (out[rows].to(acc) * mine + out_b.to(acc) * theirs).to(out.dtype)
    lse[:, rows] = merged


class _RootedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, split: RootSplit, groups, blocks, scale: float, primitive: str):
        forward_call = _PRIMITIVES[primitive][0]
        rest = split.rest
        cu_q, cu_k = rest.host_cu()
        outs, lses = [], []
        for r0, r1 in groups:  # the rest: the runs' paths without the roots, as the plain varlen call
            index = rest.key_index[cu_k[r0]: cu_k[r1]]
            o, lse = forward_call(q[cu_q[r0]: cu_q[r1]], k.index_select(0, index), v.index_select(0, index),
                                  rest.cu_q[r0: r1 + 1] - cu_q[r0], rest.cu_k[r0: r1 + 1] - cu_k[r0], True, scale)
            outs.append(o)
            lses.append(lse)
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        lse = lses[0] if len(lses) == 1 else torch.cat(lses, dim=1)
        for q0, q1, k0, k1 in blocks:
            bounds_q, bounds_k = _bounds(q1 - q0, q.device), _bounds(k1 - k0, q.device)
            o, block_lse = forward_call(q[q0:q1], k[k0:k1], v[k0:k1], bounds_q, bounds_k, False, scale)
            _merge_into(out, lse, slice(q0, q1), o, block_lse)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.split, ctx.groups, ctx.blocks, ctx.scale, ctx.primitive = split, groups, blocks, scale, primitive
        return out

    @staticmethod
    def backward(ctx, grad):
        from .varlen import _GatherRows

        q, k, v, out, lse = ctx.saved_tensors
        backward_call = _PRIMITIVES[ctx.primitive][1]
        grad = grad.contiguous()
        rest = ctx.split.rest
        cu_q, cu_k = rest.host_cu()
        acc = _acc(k.dtype)
        dk = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        dq = torch.empty_like(q)
        for r0, r1 in ctx.groups:
            rows, index = slice(cu_q[r0], cu_q[r1]), rest.key_index[cu_k[r0]: cu_k[r1]]
            dqr, dkr, dvr = backward_call(grad[rows], q[rows], k.index_select(0, index), v.index_select(0, index),
                                          out[rows], lse[:, rows].contiguous(), rest.cu_q[r0: r1 + 1] - cu_q[r0],
                                          rest.cu_k[r0: r1 + 1] - cu_k[r0], True, ctx.scale)
            dq[rows] = dqr
            for start in range(0, index.shape[0], _GatherRows.BLOCK):  # fp32 sums, bounded transient copies
                part = slice(start, start + _GatherRows.BLOCK)
                dk.index_add_(0, index[part], dkr[part].to(acc))
                dv.index_add_(0, index[part], dvr[part].to(acc))
        for q0, q1, k0, k1 in ctx.blocks:
            rows = slice(q0, q1)
            dqb, dkb, dvb = backward_call(grad[rows], q[rows], k[k0:k1], v[k0:k1], out[rows],
                                          lse[:, rows].contiguous(), _bounds(q1 - q0, q.device),
                                          _bounds(k1 - k0, q.device), False, ctx.scale)
            dq[rows] = (dq[rows].to(acc) + dqb.to(acc)).to(q.dtype)
            dk[k0:k1] += dkb.to(acc)
            dv[k0:k1] += dvb.to(acc)
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def _bounds(rows: int, device) -> torch.Tensor:
    return torch.tensor([0, rows], dtype=torch.int32, device=device)


def tree_attention_rooted(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, split: RootSplit,
                          scaling: float | None = None, primitive: str = "flash") -> torch.Tensor:
    """q ``[U, HQ, D]``, k ``[U + C, HKV, D]``, v ``[U + C, HKV, Dv]`` (context rows last) -> ``[U, HQ, Dv]``;
    ``split`` from :func:`shared_root_split`. ``primitive``: ``"flash"`` (CUDA, half precision) or ``"math"``."""
    from . import varlen

    if primitive not in _PRIMITIVES:
        raise ValueError(f"tree_attention_rooted: primitive must be one of {tuple(_PRIMITIVES)}, got {primitive!r}")
    scale = q.shape[-1] ** -0.5 if scaling is None else scaling
    limit = varlen.MAX_CALL_ELEMENTS
    cu_q, cu_k = split.rest.host_cu()
    cache = split.__dict__.setdefault("_calls", {})
    key = (q[0].numel(), k[0].numel(), limit)
    if key not in cache:
        cache[key] = (varlen.varlen_call_groups(cu_q, cu_k, *key), _block_rows(split, *key))
    groups, blocks = cache[key]
    return _RootedAttention.apply(q, k, v, split, groups, blocks, scale, primitive)
