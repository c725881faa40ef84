"""Tree attention: a token attends to its ancestors and itself (``k <= q < subtree_end[k]`` in DFS order).

The ``"sdpa"`` path builds the dense boolean mask and calls PyTorch's scaled_dot_product_attention: exact and
CPU-safe, quadratic in memory (fine for tests and small CPU batches). Faster GPU paths plug in behind
``backend`` without changing the call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._backend import _log_once
from .naive import explicit_attention

__all__ = ["CUDNN_KEY_BLOCK", "CUDNN_MIN_PAIRS_PER_RUN", "cuda_backend", "tree_attention", "tree_attention_mask"]

_BACKENDS = ("auto", "sdpa", "runs", "varlen", "cudnn")

CUDNN_MIN_PAIRS_PER_RUN = 500_000_000
"""``backend="auto"`` on CUDA takes cuDNN's attention per run (:mod:`.split`) when the runs attend to at least this
many (query, key) pairs on average, and flash varlen (one call for all runs) otherwise. Measured on the H200
(BENCHMARKS.md, seventh session): cuDNN runs ~1.5x flash's pairs per second at head dim 256, but builds an
execution plan for every new block shape (~60 ms each, four per run: two blocks, forward and backward; 12.7 s for
full-size ``swe``'s 55 runs), and a training step brings new forests. At ~5.5e-10 s saved per pair per step
(fwd, recompute and bwd over the 2B model's 6 attention layers) a run repays its ~0.24 s of plans from ~440M pairs;
below that, ``backend="cudnn"`` is for repeated shapes (benchmarks, or several passes over the same forests)."""


CUDNN_KEY_BLOCK: int | None = None
"""Shape buckets for ``backend="cudnn"`` (:func:`.split.run_blocks`): ``None`` runs every run's exact block shapes
(measured: 0.93x SDPA's pair rate on full-size ``swe``, but new plans for every new forest); an int (e.g. 4096)
runs ancestors in blocks of that many keys and rounds rows up, so the plans come from a small fixed set (exact on
CPU with explicit softmax blocks). Measured with 4096 (BENCHMARKS.md, eighth session): full-size ``swe`` 0.77-0.79x
SDPA's rate and 3.2 s of plans for a second forest (exact shapes: 11.6 s); full-size ``tau`` 0.41x (its shorter
paths waste the blocks)."""


def tree_attention_mask(subtree_end: torch.Tensor, context_tokens: int = 0, *, window: int | None = None,
                        depth: torch.Tensor | None = None) -> torch.Tensor:
    """``[U, U + C]`` bool, ``mask[q, k] = k <= q < subtree_end[k]`` (True = may attend) for the ``U`` packed keys,
    then ``C = context_tokens`` columns of True: context keys (ancestors outside the forest) every query sees.
    ``window`` (with ``depth [U]``, the tokens' depths): an ancestor is also kept only if it lies less than
    ``window`` positions above the query (sliding-window attention along each path)."""
    positions = torch.arange(subtree_end.shape[0], device=subtree_end.device)
    query, key = positions[:, None], positions[None, :]
    mask = (key <= query) & (query < subtree_end[None, :])
    if window is not None:
        if depth is None or context_tokens:
            raise ValueError("tree_attention_mask: a window needs depth=[U] and no context tokens")
        mask &= (depth[:, None] - depth[None, :]) < window
    if context_tokens:
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], context_tokens)], dim=1)
    return mask


def cuda_backend(layout) -> str:
    """What ``backend="auto"`` runs for CUDA half-precision inputs: ``"cudnn"`` when the layout's runs average at
    least :data:`CUDNN_MIN_PAIRS_PER_RUN` attended pairs, else ``"varlen"``."""
    from .split import run_blocks

    blocks = run_blocks(layout)
    return "cudnn" if blocks.pairs >= CUDNN_MIN_PAIRS_PER_RUN * len(blocks) else "varlen"


def autocast_inputs(*tensors: torch.Tensor | None) -> tuple:
    """Cast attention inputs to the autocast dtype when autocast is on for their device, as autocast does for SDPA.

    Under mixed precision with fp32 weights (HF Trainer's ``bf16=True``), RoPE's fp32 cos/sin leave queries and keys
    in fp32 while values come out of a linear in bf16; the flash kernels (and the choice of them) need the half
    precision SDPA would see. ``None`` entries pass through.
    """
    device = next(t for t in tensors if t is not None).device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(None if t is None else t.to(dtype) for t in tensors)


def common_head_dim(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
    """q, k and v zero-padded to one head dim, the larger of q/k's and v's (torch's flash and cuDNN kernels take one;
    FlashAttention-4 takes both widths where :func:`.fa4.takes_value_width` says so, and gets them unpadded): zero
    columns of q and k add nothing to a score, zero columns of v give zero output columns to cut off. Multi-head
    latent attention (DeepSeek, Kimi, Ling) has q/k heads of 192 and value heads of 128, e.g."""
    width = max(q.shape[-1], v.shape[-1])
    return tuple(t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1])) for t in (q, k, v))


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, subtree_end: torch.Tensor, *,
                   scaling: float | None = None, mask: torch.Tensor | None = None,
                   backend: str = "auto", layout=None, context_k: torch.Tensor | None = None,
                   context_v: torch.Tensor | None = None, window: int | None = None,
                   depth: torch.Tensor | None = None, softcap: float | None = None,
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention over a packed forest.

    Args:
        q, k: ``[U, HQ, D]``, ``[U, HKV, D]``; v: ``[U, HKV, Dv]`` (``Dv`` may differ from ``D``), with ``HQ`` a
            multiple of ``HKV`` (grouped-query attention).
        subtree_end: ``[U]`` long from :class:`PackedForest`. scaling: default ``D ** -0.5``.
        mask: optional precomputed :func:`tree_attention_mask` (reused across layers).
        backend: ``"sdpa"`` (dense mask, any device), ``"varlen"`` (one flash-attention varlen call over runs and
            their gathered ancestor paths; CUDA, half precision; needs ``layout``) or ``"auto"`` (varlen when
            possible, or cuDNN when the runs are long, see :data:`CUDNN_MIN_PAIRS_PER_RUN`).
            ``"runs"``: the varlen semantics with one SDPA call per run (any device; memory per run, not U x U).
            ``"cudnn"``: per run, cuDNN's attention over its ancestors and over itself (causal), merged by
            log-sum-exp (:mod:`.split`; CUDA, half precision; needs ``layout``).
        layout: a :class:`VarlenLayout` (``build_varlen_layout(packed)``) for the varlen and runs paths.
        context_k, context_v: ``[C, HKV, D]`` keys/values of ``C`` ancestors outside the forest that every query
            sees (a planner piece below a branch point: one tree, its root's ancestors). The mask and layout must
            then be built with ``context_tokens=C``.
        window: sliding-window attention: a query sees only the ancestors less than ``window`` positions above
            it (and itself), as transformers' sliding-window mask does on each path; the sdpa path needs ``depth``
            (``[U]``, the tokens' depths) or a mask built with it; not with context keys, nor on ``"cudnn"``.
        softcap: attention logit softcapping, ``c * tanh(scores / c)`` before the mask (Gemma 2).
        sinks: ``[HQ]`` attention-sink logits: one extra logit per head in every softmax whose value is zero
            (GPT-OSS). With ``softcap`` or ``sinks`` the varlen path needs FlashAttention-4 (``varlen.KERNEL``
            ``"fa4"``, or ``"auto"`` where it is installed; ``backend="auto"`` takes it then); otherwise the
            attention is computed explicitly (``"sdpa"``: dense, or ``"runs"``: per run): exact, not fast.

    Returns:
        ``[U, HQ, Dv]`` in ``q.dtype`` (the autocast dtype under autocast, see :func:`autocast_inputs`).
    """
    if backend not in _BACKENDS:
        raise ValueError(f"tree_attention: backend must be one of {_BACKENDS}, got {backend!r}")
    q, k, v, context_k, context_v = autocast_inputs(q, k, v, context_k, context_v)
    U, HQ, D = q.shape
    if k.shape[0] != U or v.shape[0] != U or k.shape[1] != v.shape[1] or k.shape[2] != D or HQ % k.shape[1]:
        raise ValueError(f"tree_attention: expected q [U, HQ, D], k [U, HKV, D] and v [U, HKV, Dv] with "
                         f"HQ % HKV == 0; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if subtree_end.shape != (U,):
        raise ValueError(f"tree_attention: subtree_end must be [U={U}], got {tuple(subtree_end.shape)}")
    if (context_k is None) != (context_v is None):
        raise ValueError("tree_attention: pass both context_k and context_v, or neither")
    if context_k is not None:
        if context_k.shape[1:] != k.shape[1:] or context_v.shape != context_k.shape[:2] + v.shape[2:]:
            raise ValueError(f"tree_attention: context_k and context_v must be [C, HKV, D] like k and v; got "
                             f"{tuple(context_k.shape)} and {tuple(context_v.shape)} for k {tuple(k.shape)}")
        k, v = torch.cat([k, context_k.to(k.dtype)]), torch.cat([v, context_v.to(v.dtype)])
    if layout is not None and layout.context_tokens != k.shape[0] - U:
        raise ValueError(f"tree_attention: the layout was built for {layout.context_tokens} context tokens but "
                         f"{k.shape[0] - U} were given; build_varlen_layout(packed, context_tokens=...) to match")
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"tree_attention: window must be a positive int (sliding-window size), got {window!r}")
        if context_k is not None:
            raise ValueError("tree_attention: sliding-window attention with context keys (a planner piece below a "
                             "branch point) is not supported; raise the token budget so each tree is one piece")
        if backend == "cudnn":
            raise ValueError("tree_attention: backend='cudnn' has no sliding window; use 'varlen' or 'auto'")
    explicit = softcap is not None or sinks is not None
    if explicit:
        if sinks is not None and sinks.shape != (HQ,):
            raise ValueError(f"tree_attention: sinks must be [HQ={HQ}], got {tuple(sinks.shape)}")
        if backend == "cudnn":
            raise ValueError("tree_attention: backend='cudnn' has no softcapping / sinks; use 'runs' or 'auto'")
        if backend == "auto":
            backend = "varlen" if _fa4_varlen(q, layout) else "runs" if layout is not None else "sdpa"
            if backend != "varlen" and q.is_cuda:
                _log_once("harts_hf: tree attention computes softcapping / sinks explicitly per run on the GPU "
                          "(exact, not fast) unless FlashAttention-4 runs the varlen path: pip install "
                          "harts_hf[fa4] (tree_varlen_kernel 'auto', the default, or 'fa4')")
    if backend == "auto" and layout is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        backend = "varlen" if window is not None or _flex_varlen(q, layout) else cuda_backend(layout)
    if backend in ("varlen", "cudnn"):
        if layout is None or not q.is_cuda:
            raise ValueError(f"tree_attention: backend={backend!r} needs CUDA tensors and a VarlenLayout (layout=...)")
        if backend == "varlen" and window is None and not explicit and _flex_varlen(q, layout):
            from .flex import layout_tables, tree_attention_flex

            return tree_attention_flex(q, k, v, subtree_end, layout.context_tokens, scaling,
                                       tables=layout_tables(layout, subtree_end))
        value_dim = v.shape[-1]
        if not (backend == "varlen" and value_dim != D and _fa4_varlen(q, layout) and _fa4_value_width(D, v)):
            q, k, v = common_head_dim(q, k, v)
        scaling = D ** -0.5 if scaling is None else scaling
        if backend == "cudnn":
            from .split import run_blocks, tree_attention_split

            out = tree_attention_split(q, k, v, run_blocks(layout, key_block=CUDNN_KEY_BLOCK), scaling)
        else:
            from .varlen import tree_attention_varlen

            out = tree_attention_varlen(q, k, v, layout, scaling, window=window, softcap=softcap, sinks=sinks)
        return out[..., :value_dim]
    if backend == "runs":
        if layout is None:
            raise ValueError("tree_attention: backend='runs' needs a VarlenLayout (layout=build_varlen_layout(packed))")
        return _attention_by_runs(q, k, v, layout, scaling, window, softcap, sinks)
    if mask is None:
        if window is not None and depth is None:
            raise ValueError("tree_attention: backend='sdpa' with a window needs depth=[U] (or a mask built with it)")
        mask = tree_attention_mask(subtree_end, k.shape[0] - U, window=window, depth=depth)
    if mask.shape != (U, k.shape[0]):
        raise ValueError(f"tree_attention: mask must be [U={U}, U + context = {k.shape[0]}], got {tuple(mask.shape)}; "
                         "build it with tree_attention_mask(subtree_end, context_tokens)")
    if explicit:
        return explicit_attention(q, k, v, mask, scaling, softcap, sinks)
    # a masked-out key still meets its query in SDPA's products (probability 0 x value): a NaN/Inf key or value
    # would spread to every query. Zero non-finite key/value rows and give NaN to the queries that see one.
    bad = ~(torch.isfinite(k).all(-1) & torch.isfinite(v).all(-1))  # [U + C, HKV]
    k, v = k.masked_fill(bad.unsqueeze(-1), 0), v.masked_fill(bad.unsqueeze(-1), 0)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask, scale=scaling, enable_gqa=HQ != k.shape[1])
    sees_bad = (mask.to(q.dtype) @ bad.to(q.dtype)) > 0  # [U, HKV]
    return out[0].transpose(0, 1).masked_fill(sees_bad.repeat_interleave(HQ // bad.shape[1], 1).unsqueeze(-1),
                                              float("nan"))


def _fa4_varlen(q: torch.Tensor, layout) -> bool:
    """Whether the varlen path runs FlashAttention-4 for ``q`` (CUDA, half precision, a layout, ``varlen.KERNEL``)."""
    if layout is None or not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    from .varlen import varlen_kernel

    return varlen_kernel(q.device) == "fa4"


def _fa4_value_width(head_dim: int, v: torch.Tensor) -> bool:
    """Whether FlashAttention-4 takes ``v``'s head width beside keys of ``head_dim`` on ``v``'s device unpadded."""
    from .fa4 import takes_value_width

    return takes_value_width(head_dim, v.shape[-1], v.device.index if v.device.index is not None
                             else torch.cuda.current_device())


def _flex_varlen(q: torch.Tensor, layout) -> bool:
    """Whether the varlen path runs FlexAttention on the packed rows: ``varlen.KERNEL`` is ``"flex"`` and the layout's
    runs gather any key row beyond their own (a forest of separate sequences gathers none: torch's flash varlen)."""
    from .varlen import varlen_kernel

    return varlen_kernel(q.device) == "flex" and layout.key_index.numel() > q.shape[0]


def _attention_by_runs(q, k, v, layout, scaling, window: int | None = None, softcap: float | None = None,
                       sinks: torch.Tensor | None = None):
    """Each run's queries against its gathered root path, bottom-right causal (within ``window`` positions, where
    given: along the path, key index and depth differ by a constant): one SDPA call per run."""
    from .varlen import gather_rows

    outputs = []
    cu_q, cu_k = layout.host_cu()
    keys, values = gather_rows(k, layout.key_index), gather_rows(v, layout.key_index)  # one fp32 sum in backward
    for run in range(len(cu_q) - 1):
        queries = q[cu_q[run]:cu_q[run + 1]]
        rows = slice(cu_k[run], cu_k[run + 1])
        length_q, length_k = queries.shape[0], rows.stop - rows.start
        ones = torch.ones(length_q, length_k, dtype=torch.bool, device=q.device)
        visible = ones.tril(length_k - length_q)
        if window is not None:
            visible &= ~ones.tril(length_k - length_q - window)
        if softcap is not None or sinks is not None:
            outputs.append(explicit_attention(queries, keys[rows], values[rows], visible, scaling, softcap, sinks))
            continue
        out = F.scaled_dot_product_attention(
            queries.transpose(0, 1).unsqueeze(0), keys[rows].transpose(0, 1).unsqueeze(0),
            values[rows].transpose(0, 1).unsqueeze(0), attn_mask=visible, scale=scaling,
            enable_gqa=q.shape[1] != k.shape[1])
        outputs.append(out[0].transpose(0, 1))
    return torch.cat(outputs)
