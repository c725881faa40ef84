"""Triton kernel of :func:`.varlen.sum_gathered_rows`: the gradient of a row gather, each output row the fp32 sum of
its copies' gradient rows, rounded once (imported only when a CUDA run, or Triton's interpreter, takes it).

Why a kernel of our own: the gather's backward is a scatter-add with many copies per row (on full-size `tau` every run
gathers the shared prompt again: 96 copies of each of its rows). torch's ``index_add_`` adds them with atomics, in
the output's dtype, so harts_hf converted the gradient rows to fp32 in blocks first (a copy of each block, then atomic
fp32 adds contending on the shared rows, then a rounding pass). Here the copies of a row are listed once per call
(``torch.sort`` of the index: CSR offsets and order), and one program per (row, column block) reads its copies in
turn, sums them in fp32 registers and writes the row once in the output dtype: no atomics, no fp32 buffer, and the
sum's order is fixed (deterministic).
"""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["W", "s0"])  # D, s1, s2 specialized: a unit stride keeps loads vectorized
def sum_rows_kernel(grad, order, offsets, out, W, D, s0, s1, s2, BW: tl.constexpr, ACCUMULATE: tl.constexpr):
    """``grad`` read as ``[rows, W // D, D]`` with element strides ``s0, s1, s2`` (a padded head's gradient is a
    strided view: read in place, not copied); ``out`` contiguous ``[num_rows, W]``, written (``ACCUMULATE``: added
    to; each program owns its row, so no atomics)."""
    row = tl.program_id(0).to(tl.int64)
    columns = tl.program_id(1) * BW + tl.arange(0, BW)
    inside = columns < W
    within = (columns // D).to(tl.int64) * s1 + (columns % D).to(tl.int64) * s2
    start = tl.load(offsets + row)
    end = tl.load(offsets + row + 1)
    total = tl.zeros([BW], dtype=tl.float32)
    for j in range(start, end):
        source = tl.load(order + j)
        total += tl.load(grad + source * s0 + within, mask=inside, other=0.0).to(tl.float32)
    if ACCUMULATE:
        total += tl.load(out + row * W + columns, mask=inside, other=0.0).to(tl.float32)
    tl.store(out + row * W + columns, total.to(out.dtype.element_ty), mask=inside)
