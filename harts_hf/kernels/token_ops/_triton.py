"""Triton RMSNorm and squared ReLU of :mod:`.ops` (RMSNorm: ``NORM_KERNEL = "harts"``; imported only when a CUDA run,
or Triton's interpreter, takes them).

Why a kernel of our own where fla has one: fla's RMSNorm backward makes its rows per program a compile-time
constant, and for widths <= 512 its forward and backward autotune per ``ceil(rows / 2048)``, so every new forest
size compiles again unless the rows are cut into a few fixed block sizes and the outputs concatenated (the
``"fla"`` path does that: ~150 ms of copies per step on full-size ``tau``). Here the row count is a runtime value
only (``do_not_specialize``): one compilation per width and dtype, one call per norm, no block copies.

Forward: each program normalises ``BT`` rows in fp32 (``x * rsqrt(mean(x^2) + eps) * w``, ``w`` plus 1 for the
offset form) and rounds once to the output dtype; it keeps ``rstd`` per row. Backward: a fixed grid of programs walks
the row blocks with a stride, writes ``dx = rstd * (dy w - x_hat * mean(dy w x_hat))`` and accumulates its share of
``dw = sum(dy * x_hat)`` in fp32; the host sums the programs' shares.
"""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["T"])
def rms_norm_fwd_kernel(x, w, y, rstd, T, D, eps, OFFSET: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    columns = tl.arange(0, BD)
    inside = (rows[:, None] < T) & (columns[None, :] < D)
    offsets = rows[:, None] * D + columns[None, :]
    xr = tl.load(x + offsets, mask=inside, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(xr * xr, 1) / D + eps)
    wr = tl.load(w + columns, mask=columns < D, other=0.0).to(tl.float32)
    if OFFSET:
        wr = wr + 1.0
    tl.store(rstd + rows, r, mask=rows < T)
    tl.store(y + offsets, (xr * r[:, None] * wr[None, :]).to(y.dtype.element_ty), mask=inside)


@triton.jit(do_not_specialize=["T", "programs"])
def rms_norm_bwd_kernel(x, w, rstd, dy, dx, dw_partial, T, D, programs, OFFSET: tl.constexpr, BT: tl.constexpr,
                        BD: tl.constexpr):
    program = tl.program_id(0)
    columns = tl.arange(0, BD)
    wr = tl.load(w + columns, mask=columns < D, other=0.0).to(tl.float32)
    if OFFSET:
        wr = wr + 1.0
    dw = tl.zeros((BD,), tl.float32)
    for start in range(program * BT, T, programs * BT):
        rows = start + tl.arange(0, BT).to(tl.int64)
        inside = (rows[:, None] < T) & (columns[None, :] < D)
        offsets = rows[:, None] * D + columns[None, :]
        xr = tl.load(x + offsets, mask=inside, other=0.0).to(tl.float32)
        g = tl.load(dy + offsets, mask=inside, other=0.0).to(tl.float32)
        r = tl.load(rstd + rows, mask=rows < T, other=0.0)
        x_hat = xr * r[:, None]
        gw = g * wr[None, :]
        mean = tl.sum(gw * x_hat, 1) / D
        tl.store(dx + offsets, ((gw - x_hat * mean[:, None]) * r[:, None]).to(dx.dtype.element_ty), mask=inside)
        dw += tl.sum(g * x_hat, 0)
    tl.store(dw_partial + program * D + columns, dw, mask=columns < D)


@triton.jit(do_not_specialize=["N"])
def relu_squared_fwd_kernel(x, y, N, B: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * B + tl.arange(0, B)
    r = tl.maximum(tl.load(x + offsets, mask=offsets < N, other=0.0).to(tl.float32), 0.0)
    tl.store(y + offsets, (r * r).to(y.dtype.element_ty), mask=offsets < N)


@triton.jit(do_not_specialize=["N"])
def relu_squared_bwd_kernel(x, dy, dx, N, B: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * B + tl.arange(0, B)
    r = tl.maximum(tl.load(x + offsets, mask=offsets < N, other=0.0).to(tl.float32), 0.0)
    g = tl.load(dy + offsets, mask=offsets < N, other=0.0).to(tl.float32)
    tl.store(dx + offsets, (2.0 * r * g).to(dx.dtype.element_ty), mask=offsets < N)


@triton.jit(do_not_specialize=["T"])
def group_gated_norm_fwd_kernel(x, z, w, y, rstd, T, eps, G: tl.constexpr, S: tl.constexpr, BT: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    columns = tl.arange(0, G * S)
    offsets = rows[:, None] * (G * S) + columns[None, :]
    inside = rows[:, None] < T
    zr = tl.load(z + offsets, mask=inside, other=0.0).to(tl.float32)
    u = tl.reshape(tl.load(x + offsets, mask=inside, other=0.0).to(tl.float32) * zr * tl.sigmoid(zr), (BT, G, S))
    r = 1.0 / tl.sqrt(tl.sum(u * u, 2) / S + eps)
    h = tl.reshape(u * r[:, :, None], (BT, G * S)).to(x.dtype.element_ty).to(tl.float32)
    wr = tl.load(w + columns).to(tl.float32)
    tl.store(rstd + rows[:, None] * G + tl.arange(0, G)[None, :], r, mask=rows[:, None] < T)
    tl.store(y + offsets, (h * wr[None, :]).to(y.dtype.element_ty), mask=inside)


@triton.jit(do_not_specialize=["T", "programs"])
def group_gated_norm_bwd_kernel(x, z, w, rstd, dy, dx, dz, dw_partial, T, programs, G: tl.constexpr, S: tl.constexpr,
                                BT: tl.constexpr):
    program = tl.program_id(0)
    columns = tl.arange(0, G * S)
    wr = tl.load(w + columns).to(tl.float32)
    dw = tl.zeros((G * S,), tl.float32)
    for start in range(program * BT, T, programs * BT):
        rows = start + tl.arange(0, BT).to(tl.int64)
        offsets = rows[:, None] * (G * S) + columns[None, :]
        inside = rows[:, None] < T
        xr = tl.load(x + offsets, mask=inside, other=0.0).to(tl.float32)
        zr = tl.load(z + offsets, mask=inside, other=0.0).to(tl.float32)
        g = tl.load(dy + offsets, mask=inside, other=0.0).to(tl.float32)
        sig = tl.sigmoid(zr)
        gate = zr * sig
        r = tl.load(rstd + rows[:, None] * G + tl.arange(0, G)[None, :], mask=rows[:, None] < T, other=0.0)
        u = tl.reshape(xr * gate, (BT, G, S))
        h = u * r[:, :, None]
        dh = tl.reshape(g * wr[None, :], (BT, G, S))
        du = tl.reshape((dh - h * (tl.sum(dh * h, 2) / S)[:, :, None]) * r[:, :, None], (BT, G * S))
        tl.store(dx + offsets, (du * gate).to(dx.dtype.element_ty), mask=inside)
        tl.store(dz + offsets, (du * xr * sig * (1.0 + zr * (1.0 - sig))).to(dz.dtype.element_ty), mask=inside)
        dw += tl.sum(g * tl.reshape(h, (BT, G * S)).to(x.dtype.element_ty).to(tl.float32), 0)
    tl.store(dw_partial + program * (G * S) + columns, dw)
