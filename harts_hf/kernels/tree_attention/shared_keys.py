"""Tree attention with shared key segments attended in place: no gathered copies of them (CUDA: flash varlen).

The varlen layout (:mod:`.varlen`) gathers every run's root-to-run key path, so a segment shared by many runs is
copied once per run below it: on full-size `tau` half the gathered key rows are copies of its 9,598-token prompt, and
for MLA's wide heads (32 key heads of 192, values padded to 192: 24.6 KB a row in bf16) the gathers and the atomic
scatter-add of their gradients cost about as much as the tree's extra attention pairs (BENCHMARKS.md, the Kimi-Linear
profile of 2026-12-06). In DFS order a segment ``[s, e)`` that ends at a branch point has every one of its
descendants in the rows ``[e, E)`` right after it (``E = subtree_end[e - 1]``), and every one of them sees all of the
segment: one unmasked call of those query rows against the segment's rows, both as they are, replaces the segment's
copies in the runs' paths. The runs' remaining paths go through one varlen call as before (a run that passes the
segment's end is cut there). Context rows (ancestors outside the forest, the planner's hand-offs) are split off the
same way: every query attends them unmasked. The partial results merge through their log-sum-exps,

    lse = logaddexp(lse_a, lse_b);   out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

and each call's backward, given the merged ``out`` and ``lse``, is exactly its share of the whole softmax's gradient
(:mod:`.split` says why).

Which segments: those whose split saves at least :data:`MIN_SAVED_ROWS` gathered key rows and whose saved key and
value elements are at least :data:`COST_FACTOR` times the extra call's query elements (:func:`shared_segment_split`),
so a prompt shared by a group is split off and a short turn under two runs is not. ``primitive="math"`` runs the same
decomposition with explicit softmax per sequence (any device, fp32/fp64): the CPU tests check it; ``"flash"`` calls
FlashAttention-2 inside torch (``aten._flash_attention_forward`` / ``_backward``, bottom-right causal, GQA as is),
``"fa4"`` FlashAttention-4 through harts_hf's dispatcher ops (:mod:`.fa4`). Opt-in
(:data:`.varlen.SHARED_KEYS_IN_PLACE`): measured on an H100 (BENCHMARKS.md, 2026-12-06), one layer's attention on
full-size `tau` took 0.87x the plain call's time at MLA's heads and 0.92x at Nemotron-H's, and the same elsewhere (the
rule takes no segment at the 2B preset's two KV heads); whole steps in planner pieces gained nothing measurable.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .split import _acc

__all__ = ["SegmentSplit", "shared_segment_split", "tree_attention_shared_keys"]

MIN_SAVED_ROWS = 1024
"""A segment is split off only where that saves at least this many gathered key rows; context rows always are."""

COST_FACTOR = 2.0
"""A segment is split off where the key and value elements it saves are at least this many times the query elements
of its extra call (which reads the queries, outputs and their gradients again and merges in fp32). A guess until the
GPU measures it (``benchmarks/attention_kernels.py --forest``)."""


@dataclass
class SegmentSplit:
    """``rest``: the runs' key paths without the split-off rows (a :class:`~.varlen.VarlenLayout` whose key index
    points into ``k``'s rows, context included); ``blocks``: ``(q_start, q_end, k_start, k_end)``, query rows that
    attend those key rows unmasked; ``saved_rows``: gathered key rows no longer gathered."""

    rest: object
    blocks: list[tuple[int, int, int, int]]
    saved_rows: int


def _segments_to_split(parent: np.ndarray, subtree_end: np.ndarray, run_starts: np.ndarray, ancestors: np.ndarray,
                       min_saved_rows: int, row_ratio: float) -> list[tuple[int, int, int]]:
    """``(s, e, E)`` of every segment ``[s, e)`` ending at a branch point worth splitting off: the gathered key rows
    it saves (``e - s`` for each run with queries in ``[e, E)``, less the ancestors of ``s`` that the run passing
    ``e`` gathers once more when it is cut there), at least ``min_saved_rows`` and at least ``row_ratio`` times the
    ``E - e`` query rows of its extra call. ``ancestors[t]``: how many forest rows are above row ``t``."""
    U = parent.shape[0]
    children = np.bincount(parent[parent >= 0], minlength=U)
    branch = np.flatnonzero(children >= 2)
    starts = np.flatnonzero((parent < 0) | (parent != np.arange(U) - 1) | (np.append(0, children[:-1]) >= 2))
    chosen = []
    for b in branch:
        s, e, E = int(starts[np.searchsorted(starts, b, side="right") - 1]), int(b) + 1, int(subtree_end[b])
        first = int(np.searchsorted(run_starts, e))
        runs = int(np.searchsorted(run_starts, E) - first) + (first >= len(run_starts) or run_starts[first] != e)
        saved = runs * (e - s) - (0 if first < len(run_starts) and run_starts[first] == e else int(ancestors[s]))
        if saved >= min_saved_rows and saved >= row_ratio * (E - e):
            chosen.append((s, e, E))
    return chosen


def shared_segment_split(layout, row_ratio: float = 1.0, min_saved_rows: int | None = None) -> SegmentSplit:
    """The split of ``layout`` (a :class:`~.varlen.VarlenLayout` built with its forest's ``parent`` and
    ``subtree_end``), cached on it per setting. ``row_ratio``: query elements per key + value elements of a row
    (a segment is split where the key rows it saves are at least :data:`COST_FACTOR` times that many times its
    call's query rows)."""
    from .varlen import VarlenLayout

    min_saved_rows = MIN_SAVED_ROWS if min_saved_rows is None else min_saved_rows
    cache = layout.__dict__.setdefault("_segment_split", {})
    key = (row_ratio, min_saved_rows, COST_FACTOR)
    if key in cache:
        return cache[key]
    if layout.parent is None:
        raise ValueError("shared_segment_split: the layout has no forest structure; build it with "
                         "build_varlen_layout(packed)")
    cu_q, cu_k = layout.host_cu()
    key_index = layout.key_index.cpu().numpy()
    U, C = cu_q[-1], layout.context_tokens
    ancestors = np.empty(U, dtype=np.int64)  # rows above each row: its place in its run's path (paths ascend)
    for r in range(len(cu_q) - 1):
        above = cu_k[r + 1] - cu_k[r] - C - (cu_q[r + 1] - cu_q[r])
        ancestors[cu_q[r]: cu_q[r + 1]] = above + np.arange(cu_q[r + 1] - cu_q[r])
    segments = _segments_to_split(layout.parent, layout.subtree_end, np.asarray(cu_q[:-1]), ancestors,
                                  min_saved_rows, COST_FACTOR * row_ratio)
    blocks = ([(0, U, U, U + C)] if C else []) + [(e, E, s, e) for s, e, E in segments]
    cuts = sorted(set(cu_q) | {e for _, e, _ in segments if e < U})  # runs passing a split segment's end: cut there
    seg = np.asarray(segments, dtype=np.int64).reshape(-1, 3)
    paths, rows = [], []
    for a, b in zip(cuts, cuts[1:]):
        r = int(np.searchsorted(cu_q, a, side="right")) - 1  # the original run holding rows [a, b)
        path = key_index[cu_k[r] + C: cu_k[r + 1] - (cu_q[r + 1] - b)]
        above = seg[(seg[:, 1] <= a) & (a < seg[:, 2])]  # split segments above row a: not in its path
        for s, e, _ in above:
            path = path[(path < s) | (path >= e)]
        paths.append(path)
        rows.append(b - a)
    saved = key_index.shape[0] - sum(p.shape[0] for p in paths)
    lengths_k = np.fromiter((p.shape[0] for p in paths), dtype=np.int64, count=len(paths))
    new_cu_q = np.zeros(len(rows) + 1, dtype=np.int32)
    new_cu_k = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum(rows, out=new_cu_q[1:])
    np.cumsum(lengths_k, out=new_cu_k[1:])
    device = layout.key_index.device
    rest = VarlenLayout(torch.from_numpy(np.concatenate(paths).astype(np.int64)).to(device),
                        torch.from_numpy(new_cu_q).to(device), torch.from_numpy(new_cu_k).to(device),
                        int(max(rows)), int(lengths_k.max()), 0, (new_cu_q.tolist(), new_cu_k.tolist()))
    cache[key] = SegmentSplit(rest, blocks, saved) if saved > 0 or C else SegmentSplit(layout, [], 0)
    return cache[key]


# --- primitives on packed rows: q [Tq, HQ, D], k/v [Tk, HKV, D]; lse float32 [HQ, Tq] ------------------------------

def _math_scores(q, k, causal: bool, scale: float) -> torch.Tensor:
    groups = q.shape[1] // k.shape[1]
    scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(groups, dim=1)) * scale
    if causal:  # bottom-right: query i sees keys up to i + (Lk - Lq)
        visible = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril(k.shape[0] - q.shape[0])
        scores = scores.masked_fill(~visible, float("-inf"))
    return scores


def _math_forward(q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float):
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


def _math_backward(grad, q, k, v, out, lse, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float):
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


def _checked_lse(lse: torch.Tensor, q: torch.Tensor, kernel: str) -> torch.Tensor:
    if lse.shape != (q.shape[1], q.shape[0]):
        raise RuntimeError(f"tree attention (shared keys): {kernel} returned a log-sum-exp of shape "
                           f"{tuple(lse.shape)}, expected (heads, rows) = {(q.shape[1], q.shape[0])}; set "
                           "varlen.SHARED_KEYS_IN_PLACE = False")
    return lse


def _flash_window(causal: bool) -> dict:
    return dict(window_size_left=-1, window_size_right=0 if causal else -1)


def _flash_forward(q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float):
    out, lse, *_ = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False,
                                                           scale=scale, **_flash_window(causal))
    return out, _checked_lse(lse, q, "flash varlen")


def _flash_backward(grad, q, k, v, out, lse, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float):
    rng = torch.zeros(2, dtype=torch.uint64, device=q.device)  # no dropout
    return torch.ops.aten._flash_attention_backward(grad, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, causal,
                                                    rng, torch.empty(0, device=q.device), scale=scale,
                                                    **_flash_window(causal))


def _fa4_forward(q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float):
    from .fa4 import _forward

    out, lse = _forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, -1, 0.0, None, causal)
    return out, _checked_lse(lse, q, "FlashAttention-4")


def _fa4_backward(grad, q, k, v, out, lse, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float):
    from .fa4 import _backward

    return _backward(grad, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, -1, 0.0, None, causal)[:3]


_PRIMITIVES = {"math": (_math_forward, _math_backward), "flash": (_flash_forward, _flash_backward),
               "fa4": (_fa4_forward, _fa4_backward)}


def _block_rows(split: SegmentSplit, q_row_elements: int, k_row_elements: int,
                limit: int) -> list[tuple[int, int, int, int]]:
    """The unmasked blocks with their query rows cut so that one call stays under ``limit`` elements."""
    from .varlen import PAD_ROWS

    for _, _, k_start, k_end in split.blocks:
        if (k_end - k_start + PAD_ROWS) * k_row_elements > limit:
            raise ValueError(f"tree attention: a shared segment of {k_end - k_start} rows is more than one flash "
                             f"varlen call can address ({limit} elements per tensor); split the forest into pieces "
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


class _SharedKeysAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, split: SegmentSplit, calls, blocks, bounds, scale: float, primitive: str):
        forward_call = _PRIMITIVES[primitive][0]
        rest = split.rest
        outs, lses = [], []
        for rows, index, cu_q, cu_k in calls:  # the rest: the runs' paths without the split segments
            o, lse = forward_call(q[rows], k.index_select(0, index), v.index_select(0, index), cu_q, cu_k,
                                  rest.max_q, rest.max_k, True, scale)
            outs.append(o)
            lses.append(lse)
        # new tensors: the blocks merge into them in place, and a checkpointing policy may keep the calls' outputs
        out = outs[0].clone() if len(outs) == 1 else torch.cat(outs)
        lse = lses[0].clone() if len(lses) == 1 else torch.cat(lses, dim=1)
        for (q0, q1, k0, k1), (bounds_q, bounds_k) in zip(blocks, bounds):
            o, block_lse = forward_call(q[q0:q1], k[k0:k1], v[k0:k1], bounds_q, bounds_k, q1 - q0, k1 - k0, False,
                                        scale)
            _merge_into(out, lse, slice(q0, q1), o, block_lse)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.split, ctx.calls, ctx.blocks, ctx.bounds = split, calls, blocks, bounds
        ctx.scale, ctx.primitive = scale, primitive
        return out

    @staticmethod
    def backward(ctx, grad):
        from .varlen import add_rows

        q, k, v, out, lse = ctx.saved_tensors
        backward_call = _PRIMITIVES[ctx.primitive][1]
        grad = grad.contiguous()
        rest = ctx.split.rest
        acc = _acc(k.dtype)
        dk = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        dq = torch.empty_like(q)
        for rows, index, cu_q, cu_k in ctx.calls:
            dqr, dkr, dvr = backward_call(grad[rows], q[rows], k.index_select(0, index), v.index_select(0, index),
                                          out[rows], lse[:, rows].contiguous(), cu_q, cu_k, rest.max_q, rest.max_k,
                                          True, ctx.scale)
            dq[rows] = dqr
            add_rows(dk, index, dkr)  # fp32 sums of the gathered rows' gradients
            add_rows(dv, index, dvr)
        for (q0, q1, k0, k1), (bounds_q, bounds_k) in zip(ctx.blocks, ctx.bounds):
            rows = slice(q0, q1)
            dqb, dkb, dvb = backward_call(grad[rows], q[rows], k[k0:k1], v[k0:k1], out[rows],
                                          lse[:, rows].contiguous(), bounds_q, bounds_k, q1 - q0, k1 - k0, False,
                                          ctx.scale)
            dq[rows] = (dq[rows].to(acc) + dqb.to(acc)).to(q.dtype)
            dk[k0:k1] += dkb.to(acc)
            dv[k0:k1] += dvb.to(acc)
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None


def tree_attention_shared_keys(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, split: SegmentSplit,
                               scaling: float | None = None, primitive: str = "flash") -> torch.Tensor:
    """q ``[U, HQ, D]``, k ``[U + C, HKV, D]``, v ``[U + C, HKV, Dv]`` (context rows last) -> ``[U, HQ, Dv]``;
    ``split`` from :func:`shared_segment_split`. ``primitive``: ``"flash"`` or ``"fa4"`` (CUDA, half precision) or
    ``"math"``."""
    from . import varlen

    if primitive not in _PRIMITIVES:
        raise ValueError(f"tree_attention_shared_keys: primitive must be one of {tuple(_PRIMITIVES)}, "
                         f"got {primitive!r}")
    scale = q.shape[-1] ** -0.5 if scaling is None else scaling
    limit = varlen.MAX_CALL_ELEMENTS
    cache = split.__dict__.setdefault("_calls", {})  # per head shape, limit and device: no host copies per call
    key = (q[0].numel(), k[0].numel(), limit, str(q.device))
    if key not in cache:
        rest, (cu_q, cu_k) = split.rest, split.rest.host_cu()
        calls = [(slice(cu_q[r0], cu_q[r1]), rest.key_index[cu_k[r0]: cu_k[r1]],  # each call's rows and grid
                  rest.cu_q[r0: r1 + 1] - cu_q[r0], rest.cu_k[r0: r1 + 1] - cu_k[r0])
                 for r0, r1 in varlen.varlen_call_groups(cu_q, cu_k, *key[:3])]
        blocks = _block_rows(split, *key[:3])
        bounds = torch.tensor([[0, q1 - q0, 0, k1 - k0] for q0, q1, k0, k1 in blocks], dtype=torch.int32,
                              device=q.device).reshape(-1, 2, 2).unbind(0)
        cache[key] = (calls, blocks, [tuple(b.unbind(0)) for b in bounds])
    calls, blocks, bounds = cache[key]
    q, k, v = (x.contiguous() for x in (q, k, v))  # the kernels read rows as they lie (a copy only if they do not)
    return _SharedKeysAttention.apply(q, k, v, split, calls, blocks, bounds, scale, primitive)
