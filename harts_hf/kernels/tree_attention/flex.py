"""Tree attention through torch's FlexAttention: the packed rows attend in place, nothing gathered.

In DFS order key ``k`` is visible to query ``q`` iff ``k <= q < subtree_end[k]``: every key is visible to one interval
of queries. Context keys (ancestors outside the forest, appended after the packed rows) are visible to every query. So
the mask is ``start[k] <= q < end[k]`` for two per-key tables, and which 128 x 128 blocks hold any visible pair, or
only visible pairs, follows from each key block's smallest and largest ``start`` and ``end``: the block mask is built
from the tables directly (no ``[U, U]`` mask), and FlexAttention's kernels skip the empty blocks and leave the full
ones unmasked. Keys and values are never copied per run, so their gradients need no scatter-add; values may be narrower
than keys (MLA). Rows are padded to a multiple of the block (a padded query sees only itself; a padded context key
nothing).

Opt-in (``varlen.KERNEL = "flex"``, ``tree_varlen_kernel="flex"``). Measured on an H100 (BENCHMARKS.md, 2026-12-06),
one layer's attention fwd+bwd on whole forests against the gathering varlen call: 0.63-0.92x its time at Nemotron-H's
heads of 128, 0.91-1.40x at MLA's 192, 1.7-2.0x at the 2B preset's 256 (compiled per length, then once for any), at
0.3-0.7x its peak memory. The keep-attention checkpointing policy does not keep FlexAttention's outputs: the rerun
recomputes them.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["BLOCK", "DYNAMIC", "flex_block_tables", "layout_tables", "tree_attention_flex"]

BLOCK = 128
"""FlexAttention's block (query and key rows per tile of its block mask)."""


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    return x if x.shape[0] == rows else torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])])


def flex_block_tables(subtree_end: torch.Tensor, context_tokens: int = 0, block: int = BLOCK) -> dict:
    """The per-key visibility tables and the block mask's index tensors for ``U`` packed rows and ``C`` context keys.

    Returns ``start``/``end`` (``[K]`` int32: query ``q`` sees key ``k`` iff ``start[k] <= q < end[k]``), the padded
    lengths ``rows`` (queries, packed keys) and ``keys`` (packed then context keys), and ``kv_num_blocks`` /
    ``kv_indices`` (partial blocks) and ``full_kv_num_blocks`` / ``full_kv_indices`` (every pair visible) shaped as
    ``BlockMask.from_kv_blocks`` takes them (``[1, 1, Q]`` and ``[1, 1, Q, KB]``)."""
    device = subtree_end.device
    num_tokens = subtree_end.shape[0]
    rows = -(-max(num_tokens, 1) // block) * block
    context_rows = -(-context_tokens // block) * block
    keys = rows + context_rows
    index = torch.arange(keys, device=device, dtype=torch.int64)
    start = torch.where(index < rows, index, torch.zeros_like(index))
    end = torch.where(index < rows, index + 1, torch.zeros_like(index))  # padded rows: themselves only
    end[:num_tokens] = subtree_end.to(torch.int64)
    end[rows: rows + context_tokens] = rows  # context keys: every query
    empty = start >= end
    tiles = lambda x: x.view(-1, block)  # noqa: E731
    start_min = tiles(torch.where(empty, keys, start)).amin(1)
    start_max = tiles(start).amax(1)
    end_min = tiles(end).amin(1)
    end_max = tiles(torch.where(empty, 0, end)).amax(1)
    first = torch.arange(0, rows, block, device=device)[:, None]  # each query block's first row
    last = first + block - 1
    visible = (start_min[None, :] <= last) & (end_max[None, :] > first)  # some pair may be visible
    full = (start_max[None, :] <= first) & (end_min[None, :] > last) & ~tiles(empty).any(1)[None, :]
    partial = visible & ~full

    def ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        counts = blocks.sum(1, dtype=torch.int32)
        order = torch.argsort(blocks.to(torch.int8), dim=1, descending=True, stable=True).to(torch.int32)
        return counts[None, None], order[None, None].contiguous()

    kv_num_blocks, kv_indices = ordered(partial)
    full_kv_num_blocks, full_kv_indices = ordered(full)
    return dict(start=start.to(torch.int32), end=end.to(torch.int32), rows=rows, keys=keys,
                kv_num_blocks=kv_num_blocks, kv_indices=kv_indices, full_kv_num_blocks=full_kv_num_blocks,
                full_kv_indices=full_kv_indices)


def _block_mask(tables: dict, block: int):
    """FlexAttention's ``BlockMask`` of ``tables``, built once per tables (every layer of a forest shares it)."""
    from torch.nn.attention.flex_attention import BlockMask

    if "_block_mask" in tables:
        return tables["_block_mask"]
    start, end = tables["start"], tables["end"]

    def visible(b, h, q_idx, kv_idx):
        return (start[kv_idx] <= q_idx) & (q_idx < end[kv_idx])

    tables["_block_mask"] = BlockMask.from_kv_blocks(
        tables["kv_num_blocks"], tables["kv_indices"], tables["full_kv_num_blocks"], tables["full_kv_indices"],
        BLOCK_SIZE=block, mask_mod=visible, seq_lengths=(tables["rows"], tables["keys"]))
    return tables["_block_mask"]


DYNAMIC = True
"""Compile FlexAttention for symbolic lengths (one compilation for every forest size) rather than once per padded
length (a training step brings new forests)."""


@functools.cache
def _compiled_flex(dynamic: bool):
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=dynamic)


def tree_attention_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, subtree_end: torch.Tensor,
                        context_tokens: int = 0, scaling: float | None = None, tables: dict | None = None,
                        compiled: bool | None = None) -> torch.Tensor:
    """q ``[U, HQ, D]``, k ``[U + C, HKV, D]``, v ``[U + C, HKV, DV]`` (``HQ`` a multiple of ``HKV``; ``DV`` may differ
    from ``D``; the last ``C = context_tokens`` rows are keys every query sees) -> ``[U, HQ, DV]``.

    ``tables``: :func:`flex_block_tables` of this forest and ``C`` (build once per forest and reuse across layers).
    ``compiled``: run FlexAttention's fused kernels through ``torch.compile`` (default: on CUDA); eager runs its
    reference (a dense score matrix: small inputs only, as on the CPU in the tests)."""
    from torch.nn.attention.flex_attention import flex_attention

    num_tokens = q.shape[0]
    if k.shape[0] != num_tokens + context_tokens or v.shape[0] != k.shape[0]:
        raise ValueError(f"tree_attention_flex: k and v need U + C = {num_tokens} + {context_tokens} rows, got "
                         f"{k.shape[0]} and {v.shape[0]}")
    if tables is None:
        tables = flex_block_tables(subtree_end, context_tokens)
    rows, keys = tables["rows"], tables["keys"]
    keys_all, values_all = _pad_rows(k[:num_tokens], rows), _pad_rows(v[:num_tokens], rows)
    if context_tokens:
        keys_all = torch.cat([keys_all, _pad_rows(k[num_tokens:], keys - rows)])
        values_all = torch.cat([values_all, _pad_rows(v[num_tokens:], keys - rows)])
    as_heads = lambda x: x.transpose(0, 1).unsqueeze(0)  # noqa: E731  [L, H, D] -> [1, H, L, D]
    if compiled is None:
        compiled = q.is_cuda
    inputs = (as_heads(_pad_rows(q, rows)), as_heads(keys_all), as_heads(values_all))
    options = dict(block_mask=_block_mask(tables, BLOCK), scale=scaling, enable_gqa=q.shape[1] != k.shape[1])
    if not compiled:
        return flex_attention(*inputs, **options)[0, :, :num_tokens].transpose(0, 1)
    # torch.compile skips frames while a Python dispatch mode is active (and FlexAttention would then run its dense
    # reference): the keep-attention checkpointing policy's mode is active in attention modules, so the compiled call
    # runs outside it, unseen by the policy in the forward and in the rerun alike (recomputed, not kept). Autocast is
    # off inside (the inputs are in its dtype already): its state is a guard, and the forward under autocast against
    # the rerun without it recompiled up to dynamo's limit, past which FlexAttention ran its dense reference (564 GiB
    # asked for on full-size `tau`, H100, 2026-12-06); reaching the limit now raises instead.
    from torch._dynamo.exc import FailOnRecompileLimitHit
    from torch.utils._python_dispatch import _disable_current_modes

    try:
        with _disable_current_modes(), torch.autocast(q.device.type, enabled=False), \
                torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            out = _compiled_flex(DYNAMIC)(*inputs, **options)
    except FailOnRecompileLimitHit as error:
        raise RuntimeError(
            "tree attention (varlen KERNEL 'flex'): FlexAttention's compiled call reached torch.compile's recompile "
            "limit, past which it would run its dense reference (a [heads, U, U] score matrix). Set "
            "tree_varlen_kernel='torch' (or varlen.KERNEL = 'torch'), or report the shapes that recompile "
            "(TORCH_LOGS=recompiles)") from error
    return out[0, :, :num_tokens].transpose(0, 1)


def layout_tables(layout, subtree_end: torch.Tensor) -> dict:
    """:func:`flex_block_tables` of a :class:`.varlen.VarlenLayout`'s forest and context rows, built once per layout
    (every attention layer of a forward, and the backward's reruns, share them)."""
    if "_flex_tables" not in layout.__dict__:
        layout.__dict__["_flex_tables"] = flex_block_tables(subtree_end, layout.context_tokens)
    return layout.__dict__["_flex_tables"]
