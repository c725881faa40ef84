"""Tree attention as one variable-length flash-attention call (CUDA).

The DFS layout splits into runs (contiguous chains; a branch point's first child continues its parent's
run). A run's queries attend to the run's own tokens causally and to every ancestor of its first token:
its keys are the gathered root-to-run path, and bottom-right causal alignment (``window_size=(-1, 0)``)
gives exactly ancestor-or-self visibility. Key rows gathered = sum over runs of the run's end depth.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import math
import os
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.weak import WeakTensorKeyDictionary

from ...trees import PackedForest

__all__ = ["GATHER_SUM", "KERNEL", "SHARED_KEYS_IN_PLACE", "VarlenLayout", "build_varlen_layout", "gather_rows",
           "sum_gathered_rows", "tree_attention_varlen", "varlen_available", "varlen_call_groups", "varlen_kernel"]

MAX_CALL_ELEMENTS = (1 << 31) - 1
"""Most elements of the query or key tensor in one ``varlen_attn`` call, counting the 128 padding rows per sequence
of flash's backward (its fp32 ``dq`` accumulator): row offsets are 32-bit there. On the H200 (torch 2.11) a
per-trajectory varlen call over ~600k rows of 16 heads x 256 raised an illegal memory access. Larger layouts are
split into several calls by runs (benchmarks/varlen_limits.py)."""
PAD_ROWS = 128  # per sequence, in flash's backward accumulator

KERNEL = "auto"
"""The varlen kernel: ``"auto"`` (the default: ``"fa4"`` where FlashAttention-4 imports, with the functions harts_hf
calls, on a GPU of compute capability 9.x or 10.x, else ``"torch"``), ``"torch"`` (torch's ``varlen_attn``,
FlashAttention-2 inside torch), ``"fa4"`` (FlashAttention-4's CuTe-DSL kernels, package ``flash-attn-4``, module
``flash_attn.cute``: wgmma kernels on Hopper, head dims up to 256, GQA, varlen, bottom-right causal; called through
harts_hf's dispatcher ops, :mod:`.fa4`, so checkpointing can keep its outputs; an error where it is not installed) or
``"flex"`` (torch's FlexAttention on the packed rows, :mod:`.flex`: no key or value row gathered per run, for forests
whose runs would gather any; torch's kernel for the rest, and with a window, softcapping or sinks).
Measured on the H200 (BENCHMARKS.md, 2026-12-02): fa4 takes full-size `tau`'s tree step from 5.91 to 5.32 s, the
packed baseline's calls of changing lengths compiled nothing noticeable, and the no-sharing control ran level with it;
on H100s (2026-12-06 and 07) it took the `tau` tree from 5.81 to 5.35 s and Nemotron-H's full-size `swe` tree (heads
of 128, in pieces) from 14.31 to 13.02 s, 0.958 and 0.976 of the FLOP ratio against the packed path's cuDNN calls
(torch's flash varlen: 0.872-0.899). FlashAttention-4 is a separate install (``harts_hf[fa4]``, a beta release), so
without it nothing changes; with it, ``"auto"`` runs it (since 2026-12-07; ``"torch"`` was the default before), and
its first call in a process compiles its kernels (~45 s on an H100)."""


SHARED_KEYS_IN_PLACE = False
"""Attend key segments shared by many runs (and any context rows) in place, in one unmasked call per segment merged
through the log-sum-exp, instead of gathering a copy of them for every run (:mod:`.shared_keys`), on either kernel;
not with a window, softcapping or sinks. Opt-in: exact on the CPU (explicit-softmax primitive); on an H100 faster for
MLA's wide heads in the attention alone, no whole step measured faster yet (BENCHMARKS.md, 2026-12-06; on
FlashAttention-4 with MLA's values unpadded, 2026-12-07: 0.98x the plain call alone, Kimi's whole `tau` step within
its runs' spread)."""


@dataclass
class VarlenLayout:
    """``key_index [Tk]`` (long): packed index of every key row (``U + i`` = context row ``i``); ``cu_q``/``cu_k``
    (int32, ``R + 1``); ``max_q``/``max_k``: longest run / path; ``context_tokens``: context rows every path starts
    with."""

    key_index: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    context_tokens: int = 0
    host: tuple[list[int], list[int]] | None = None  # cu_q and cu_k as Python lists (no device sync to read)
    parent: np.ndarray | None = None  # the forest's parent and subtree_end (host), for :mod:`.shared_keys`
    subtree_end: np.ndarray | None = None

    def to(self, device) -> VarlenLayout:
        return VarlenLayout(self.key_index.to(device), self.cu_q.to(device), self.cu_k.to(device), self.max_q,
                            self.max_k, self.context_tokens, self.host_cu(), self.parent, self.subtree_end)

    def host_cu(self) -> tuple[list[int], list[int]]:
        if self.host is None:
            self.host = (self.cu_q.tolist(), self.cu_k.tolist())
        return self.host


def build_varlen_layout(packed: PackedForest, context_tokens: int = 0) -> VarlenLayout:
    """Runs and their root-to-run key paths (numpy, linear in the gathered key rows).

    ``context_tokens``: ``C`` ancestors outside the forest (keys ``U .. U + C - 1``, appended after the packed
    keys) that start every root's path."""
    parent = packed.parent.cpu().numpy()
    depth = packed.position_ids.cpu().numpy()
    num_tokens = parent.shape[0]
    run_start = np.flatnonzero((parent < 0) | (parent != np.arange(num_tokens) - 1))
    run_end = np.append(run_start[1:], num_tokens)
    run_of_token = np.repeat(np.arange(run_start.shape[0]), run_end - run_start)
    paths = []
    for start, end in zip(run_start, run_end):
        own = np.arange(start, end)
        p = parent[start]
        if p < 0:
            paths.append(np.concatenate([np.arange(num_tokens, num_tokens + context_tokens), own]))
            continue
        ancestors = paths[run_of_token[p]][: depth[p] + 1]  # the parent run's path up to the branch point
        paths.append(np.concatenate([ancestors, own]))
    lengths_q = run_end - run_start
    lengths_k = np.fromiter((len(path) for path in paths), dtype=np.int64, count=len(paths))
    cu_q = np.zeros(len(paths) + 1, dtype=np.int32)
    cu_k = np.zeros(len(paths) + 1, dtype=np.int32)
    np.cumsum(lengths_q, out=cu_q[1:])
    np.cumsum(lengths_k, out=cu_k[1:])
    return VarlenLayout(torch.from_numpy(np.concatenate(paths).astype(np.int64)), torch.from_numpy(cu_q),
                        torch.from_numpy(cu_k), int(lengths_q.max()), int(lengths_k.max()), context_tokens,
                        (cu_q.tolist(), cu_k.tolist()), parent, packed.subtree_end.cpu().numpy())


GATHER_SUM = "rows"
"""How the backward of a row gather (the keys and values each run gathers) sums the copies' gradients into their rows:
``"rows"`` (the default; on CUDA, :mod:`._triton_rows`: each row's copies listed by a sort of the index, summed in
fp32 registers by one program per row and column block, written once in the input's dtype: no atomics, no fp32
buffer, a fixed order; CPU and fp64 tensors take ``"index_add"``, except CPU ones under Triton's interpreter, where the
kernel is checked) or ``"index_add"`` (gradient rows converted to fp32 in blocks, ``index_add_`` into an fp32 buffer,
rounded once; the default before 2026-12-06). Both round each row's fp32 sum once. On an H100 (BENCHMARKS.md)
``"rows"`` took MLA's attention fwd+bwd on full-size `tau` from 0.44 s to 0.33-0.34 s and Kimi's `tau` step from
5.76-5.78 s to 5.44-5.46 s, with the same gradients; the 2B preset's two key heads gain little. The shared-keys path
(:data:`SHARED_KEYS_IN_PLACE`) adds its calls' sums into fp32 totals through the same kernel (:func:`add_rows`)."""


def sum_gathered_rows(grad: torch.Tensor, index: torch.Tensor, num_rows: int, dtype: torch.dtype) -> torch.Tensor:
    """``[num_rows, ...]`` in ``dtype``: row ``u`` the fp32 sum of ``grad[j]`` over ``index[j] == u``, rounded once
    (the backward of ``x.index_select(0, index)``), by :data:`GATHER_SUM`'s method."""
    shape = (num_rows, *grad.shape[1:])
    if not _takes_kernel(grad):
        total = torch.zeros(shape, dtype=torch.promote_types(grad.dtype, torch.float32), device=grad.device)
        return add_rows(total, index, grad).to(dtype)
    out = torch.empty(shape, dtype=dtype, device=grad.device)
    _sum_rows(out, index, grad, accumulate=False)
    return out


def _takes_kernel(grad: torch.Tensor) -> bool:
    """Whether :data:`GATHER_SUM` sends ``grad``'s sum to the Triton kernel (CUDA, or Triton's interpreter; not
    fp64: the kernel sums in fp32)."""
    if GATHER_SUM not in ("index_add", "rows"):
        raise ValueError(f"tree attention: varlen GATHER_SUM must be 'index_add' or 'rows', got {GATHER_SUM!r}")
    return GATHER_SUM == "rows" and (grad.is_cuda or _interpreting()) and grad.dtype != torch.float64


def _sum_rows(out: torch.Tensor, index: torch.Tensor, grad: torch.Tensor, accumulate: bool) -> None:
    """The Triton kernel: row ``u`` of ``out`` (contiguous) the fp32 sum of ``grad[j]`` over ``index[j] == u``
    (``accumulate``: plus its value), one program per row and column block."""
    from ._triton_rows import sum_rows_kernel

    order, offsets = _copies_of_rows(index, out.shape[0])
    width = math.prod(grad.shape[1:])  # (not grad[0]: a call may gather no rows)
    block = min(1024, 1 << max(width - 1, 1).bit_length())
    if out.shape[0]:
        rows = _as_rows_heads_dims(grad)
        sum_rows_kernel[(out.shape[0], -(-width // block))](rows, order, offsets, out, width, rows.shape[2],
                                                             *rows.stride(), BW=block, ACCUMULATE=accumulate)


def _as_rows_heads_dims(grad: torch.Tensor) -> torch.Tensor:
    """``grad`` as a ``[rows, heads, dim]`` view with its own strides (flash's gradient of a value head padded to the
    key width is a slice: read in place), copied only where no such view exists."""
    if grad.dim() == 3:
        return grad
    if grad.dim() == 2:
        return grad.unsqueeze(1)
    return grad.reshape(grad.shape[0], -1, grad.shape[-1])  # a view where the middle dimensions merge


_COPIES = WeakTensorKeyDictionary()  # index tensor -> (rows, order, offsets, its version)


def _copies_of_rows(index: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each row's copies are in ``index``: ``order`` (positions sorted by row, stable) and ``offsets``
    (``[num_rows + 1]``: row ``u``'s copies are ``order[offsets[u]:offsets[u + 1]]``), kept per index tensor while it
    lives (a layout's key index is gathered for keys and values in every attention layer's backward)."""
    cached = _COPIES.get(index)
    if cached is not None and cached[0] == num_rows and cached[3] == index._version:
        return cached[1], cached[2]
    order = torch.argsort(index, stable=True)
    offsets = torch.zeros(num_rows + 1, dtype=torch.int64, device=index.device)
    torch.cumsum(torch.bincount(index, minlength=num_rows), 0, out=offsets[1:])
    _COPIES[index] = (num_rows, order, offsets, index._version)
    return order, offsets


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


class _GatherRows(torch.autograd.Function):
    """``x.index_select(0, index)`` whose backward sums the gathered rows' gradients in fp32 and rounds once (the
    plain backward accumulates them in ``x``'s dtype: a shared prefix's key gradient gathers one term per run)."""

    BLOCK = 1 << 18  # gradient rows converted to fp32 at a time (bounds the transient copy)

    @staticmethod
    def forward(ctx, x, index):
        ctx.save_for_backward(index)
        ctx.shape, ctx.dtype = x.shape, x.dtype
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        return sum_gathered_rows(grad, index, ctx.shape[0], ctx.dtype), None


def add_rows(total: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``total.index_add_(0, index, rows)`` in ``total``'s (fp32) dtype: by the Triton kernel where
    :data:`GATHER_SUM` sends it there (``total`` contiguous fp32), else converting :attr:`_GatherRows.BLOCK` rows at a
    time (bounds the transient copy); returns ``total``."""
    if total.dtype == torch.float32 and total.is_contiguous() and _takes_kernel(rows):
        _sum_rows(total, index, rows, accumulate=True)
        return total
    for start in range(0, index.shape[0], _GatherRows.BLOCK):
        part = slice(start, start + _GatherRows.BLOCK)
        total.index_add_(0, index[part], rows[part].to(total.dtype))
    return total


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows ``index`` of ``x`` (``[N, ...]``); repeated rows' gradients are summed in fp32 and rounded once."""
    return _GatherRows.apply(x, index)


def gqa_keyword(varlen_attn) -> dict:
    """``enable_gqa=True`` where torch's ``varlen_attn`` takes it (newer torch); older builds are GQA-aware as is."""
    return {"enable_gqa": True} if "enable_gqa" in inspect.signature(varlen_attn).parameters else {}


@functools.cache
def _fa4_importable() -> bool:
    return importlib.util.find_spec("flash_attn") is not None and importlib.util.find_spec("flash_attn.cute") is not None


def _fa4_interface_ok() -> bool:
    """Whether the installed FlashAttention-4 has the functions harts_hf's ops call (``"auto"`` falls back to torch's
    kernel, saying why once, when it does not)."""
    from .fa4 import check_interface

    try:
        check_interface()
    except ImportError as error:
        from .._backend import _log_once

        _log_once(f"harts_hf: varlen KERNEL='auto' uses torch's flash varlen: {error}")
        return False
    return True


def varlen_kernel(device: torch.device, choice: str | None = None) -> str:
    """``"torch"``, ``"fa4"`` or ``"flex"`` on ``device`` under ``choice`` (default :data:`KERNEL`)."""
    choice = KERNEL if choice is None else choice
    if choice not in ("auto", "torch", "fa4", "flex"):
        raise ValueError(f"tree attention: varlen KERNEL must be 'auto', 'torch', 'fa4' or 'flex', got {choice!r}")
    if choice == "auto":
        usable = _fa4_importable() and torch.cuda.get_device_capability(device)[0] in (9, 10) and _fa4_interface_ok()
        return "fa4" if usable else "torch"
    if choice == "fa4" and not _fa4_importable():
        raise ImportError("tree attention: KERNEL='fa4' needs FlashAttention-4: pip install flash-attn-4")
    return choice


def _varlen_call(kernel: str, q, k, v, cu_q, cu_k, max_q: int, max_k: int, scaling, extra: dict,
                 window: int | None = None, softcap: float | None = None, sinks=None) -> torch.Tensor:
    """One bottom-right causal varlen attention call on ``kernel`` (``window``: keys less than ``window`` rows
    before the query's diagonal; ``softcap`` / ``sinks``: FlashAttention-4 only)."""
    if kernel == "fa4":
        from .fa4 import fa4_varlen

        return fa4_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scaling, window, softcap, sinks)
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scaling,
                       window_size=(-1 if window is None else window - 1, 0), **extra)


def varlen_available() -> bool:
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def varlen_call_groups(cu_q: list[int], cu_k: list[int], q_row_elements: int, k_row_elements: int,
                       limit: int | None = None) -> list[tuple[int, int]]:
    """Consecutive run ranges ``[(r0, r1), ...]`` covering every run, each with at most ``limit`` (default
    :data:`MAX_CALL_ELEMENTS`) query elements and key elements (rows plus :data:`PAD_ROWS` per run); one range when
    everything fits."""
    limit = MAX_CALL_ELEMENTS if limit is None else limit
    groups, first, runs = [], 0, len(cu_q) - 1
    for r in range(runs):
        q_rows, k_rows = cu_q[r + 1] - cu_q[r] + PAD_ROWS, cu_k[r + 1] - cu_k[r] + PAD_ROWS
        if q_rows * q_row_elements > limit or k_rows * k_row_elements > limit:
            raise ValueError(f"tree attention: run {r} has {q_rows} queries and {k_rows} keys, more than one flash "
                             f"varlen call can address ({limit} elements per tensor); split the forest into pieces "
                             "(TreeGRPOConfig.tree_token_budget / harts_hf.planner.plan(token_budget=...))")
        pad = PAD_ROWS * (r + 1 - first)
        if ((cu_q[r + 1] - cu_q[first] + pad) * q_row_elements > limit
                or (cu_k[r + 1] - cu_k[first] + pad) * k_row_elements > limit):
            groups.append((first, r))
            first = r
    groups.append((first, runs))
    return groups


def tree_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: VarlenLayout,
                          scaling: float | None = None, window: int | None = None, softcap: float | None = None,
                          sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q ``[U, HQ, D]``, k/v ``[U, HKV, D]`` on CUDA (bf16/fp16) -> ``[U, HQ, D]``; one varlen call, or several
    over consecutive runs where one call would pass :data:`MAX_CALL_ELEMENTS`. ``softcap`` (logit softcapping)
    and ``sinks`` (``[HQ]`` sink logits) need the ``"fa4"`` kernel."""
    from torch.nn.attention.varlen import varlen_attn

    kernel = varlen_kernel(q.device)
    kernel = "torch" if kernel == "flex" else kernel  # FlexAttention's cases are routed before (ops.tree_attention)
    if (softcap is not None or sinks is not None) and kernel != "fa4":
        raise ValueError("tree attention: softcapping / sinks on the varlen path need FlashAttention-4 "
                         f"(varlen KERNEL is {KERNEL!r}, which runs {kernel!r}): pip install harts_hf[fa4] on a "
                         "Hopper / Blackwell GPU with KERNEL 'auto' or 'fa4' (from harts_hf.kernels.tree_attention "
                         "import varlen), or use backend='runs' (exact, slow)")
    features = dict(window=window, softcap=softcap, sinks=sinks)
    if SHARED_KEYS_IN_PLACE and layout.parent is not None and all(value is None for value in features.values()):
        from .shared_keys import shared_segment_split, tree_attention_shared_keys

        split = shared_segment_split(layout, q[0].numel() / (k[0].numel() + v[0].numel()))
        if split.blocks:
            return tree_attention_shared_keys(q, k, v, split, scaling, "flash" if kernel == "torch" else "fa4")
    extra = gqa_keyword(varlen_attn) if q.shape[1] != k.shape[1] and kernel == "torch" else {}
    cu_q, cu_k = layout.host_cu()
    cache = layout.__dict__.setdefault("_call_groups", {})  # per layout, head shape and limit (as run_blocks caches)
    key = (q[0].numel(), k[0].numel(), MAX_CALL_ELEMENTS)
    if key not in cache:
        # each call's key index and offsets made once per layout (the index tensor is also what the gathers' backward
        # keys its lists of copies on: one tensor for keys and values of every layer)
        cache[key] = [(cu_q[r0], cu_q[r1], layout.key_index[cu_k[r0]: cu_k[r1]],
                       layout.cu_q[r0: r1 + 1] - cu_q[r0], layout.cu_k[r0: r1 + 1] - cu_k[r0])
                      for r0, r1 in varlen_call_groups(cu_q, cu_k, *key)]
    groups = cache[key]
    if len(groups) == 1:
        keys, values = gather_rows(k, layout.key_index), gather_rows(v, layout.key_index)
        return _varlen_call(kernel, q, keys, values, layout.cu_q, layout.cu_k, layout.max_q, layout.max_k, scaling,
                            extra, **features)
    outputs = []
    for q0, q1, index, offsets_q, offsets_k in groups:
        outputs.append(_varlen_call(kernel, q[q0: q1], gather_rows(k, index), gather_rows(v, index),
                                    offsets_q, offsets_k, layout.max_q, layout.max_k, scaling, extra, **features))
    return torch.cat(outputs)
