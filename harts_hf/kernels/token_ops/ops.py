"""RMSNorm, the gated RMSNorm and SwiGLU on fused kernels for CUDA tensors (RMSNorm on harts_hf's own by default,
the others on fla's); the references elsewhere.

The fused RMSNorm (harts_hf's or fla's ``rms_norm``) normalises in fp32 and rounds once to the input's dtype (one
read and one write each way; the reference spends ~6 passes forward); an offset weight (``1 + w``) is passed to
fla's as that sum. fla's ``swiglu``
reads gate and up once and writes the product (the reference writes ``silu(gate)`` first). Both differ from the
references only by rounding (fp32 math, one rounding at the end).
"""

from __future__ import annotations

import functools

import torch

from .. import _backend
from .._backend import fla_available, in_row_blocks
from .naive import (
    gated_rms_norm_reference,
    group_gated_rms_norm_reference,
    kda_gate_reference,
    relu_squared_reference,
    rms_norm_reference,
    swiglu_reference,
)

__all__ = ["BACKEND", "NORM_KERNEL", "gated_rms_norm", "group_gated_rms_norm", "kda_gate", "relu_squared", "rms_norm",
           "swiglu", "token_ops_backend"]

BACKEND = "auto"
"""``"auto"``: fla's kernels for CUDA tensors where fla imports, the references otherwise; ``"torch"``: always the
references (benchmarks' A/B); ``"fla"``: always fla (CUDA, or CPU under Triton's interpreter)."""

NORM_KERNEL = "harts"
"""Which fused kernel :func:`rms_norm` runs where :data:`BACKEND` resolves to ``"fla"``: ``"harts"`` (harts_hf's
Triton kernel, :mod:`._triton`: one compilation per width and dtype, one call per norm whatever the row count; the
default) or ``"fla"`` (fla's ``rms_norm`` on fixed row blocks). Same speed on full-size ``tau``'s tree step on the
H200 (5.00 against 5.08 s, inside the runs' spread: BENCHMARKS.md, the kernel A/B table), but in training, where
every step's forest has a new size, fla's kernel compiled and autotuned again whenever a new row block appeared:
TreeSFTTrainer steps on the 2.3B preset took 16 s instead of 1.5 s, 12 s of it compiling 15 RMSNorm variants
(``python -m benchmarks sft``'s per-step Triton compilations, 2026-12-02)."""

_NORM_ROW_TILE = 2048
"""fla's RMSNorm kernels specialise on the row count: the backward's rows per program (``ceil(rows / SMs)``) is a
compile-time constant at every width, and for widths <= 512 the forward and backward also autotune once per
``ceil(rows / 2048)``. On the H200 the packed baseline's new forest sizes cost 30-70 s of compilation each. So
:func:`rms_norm` calls fla on blocks of 2048 x 2**j rows only (:func:`_power_of_two_blocks`): at most seven shapes
per width, whatever the forest."""


def token_ops_backend(x: torch.Tensor, choice: str | None = None) -> str:
    """``"fla"`` or ``"torch"`` for ``x`` under ``choice`` (default :data:`BACKEND`)."""
    choice = BACKEND if choice is None else choice
    if choice not in ("auto", "torch", "fla"):
        raise ValueError(f"token ops: backend must be 'auto', 'torch' or 'fla', got {choice!r}")
    if choice == "auto":
        return "fla" if x.is_cuda and fla_available() else "torch"
    return choice


@functools.cache
def _fla():
    from fla.modules.activations import swiglu as fla_swiglu
    from fla.modules.norm.fused_norm_gate import rms_norm_gated as fla_rms_norm_gated
    from fla.modules.norm.layernorm import rms_norm as fla_rms_norm

    return fla_rms_norm, fla_swiglu, fla_rms_norm_gated


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, offset: bool, fp32_weight: bool | None = None,
             backend: str | None = None) -> torch.Tensor:
    """RMSNorm of ``x [..., D]`` with ``weight [D]`` as :func:`~.naive.rms_norm_reference` computes it (``offset``:
    ``1 + weight``; ``fp32_weight``: the weight applied in fp32, the result in ``x``'s dtype), on a fused kernel when
    ``backend`` resolves to ``"fla"``."""
    fp32_weight = offset if fp32_weight is None else fp32_weight
    if token_ops_backend(x, backend) == "torch":
        return rms_norm_reference(x, weight, eps, offset=offset, fp32_weight=fp32_weight)
    out_dtype = x.dtype if fp32_weight else torch.promote_types(weight.dtype, x.dtype)
    rows = x.reshape(-1, x.shape[-1])
    if NORM_KERNEL == "harts":
        return _TritonRMSNorm.apply(rows, weight, eps, offset, out_dtype).reshape(x.shape)
    if NORM_KERNEL != "fla":
        raise ValueError(f"token ops: NORM_KERNEL must be 'fla' or 'harts', got {NORM_KERNEL!r}")
    fla_rms_norm = _fla()[0]
    scale = 1.0 + weight.float() if offset else weight
    y = _power_of_two_blocks(functools.partial(fla_rms_norm, weight=scale, bias=None, eps=eps), rows)
    return y.reshape(x.shape).to(out_dtype)


def _power_of_two_blocks(function, rows: torch.Tensor) -> torch.Tensor:
    """``function(rows)`` for a ROW-WISE ``function``, called on consecutive blocks of ``2048 * 2**j`` rows (at most
    :data:`~.._backend.FLA_ROW_BUCKET`; the binary digits of the row count) and concatenated; the last ``< 2048``
    rows are zero-padded to 2048 and cut off again (the padding's gradient is zero)."""
    sizes, left = [], rows.shape[0]
    while left >= _NORM_ROW_TILE:
        block = min(_backend.FLA_ROW_BUCKET, _NORM_ROW_TILE << ((left // _NORM_ROW_TILE).bit_length() - 1))
        sizes.append(block)
        left -= block
    blocks = list(rows.split(sizes + ([left] if left else [])))
    if left:
        blocks[-1] = torch.nn.functional.pad(blocks[-1], (0, 0, 0, _NORM_ROW_TILE - left))
    outputs = [function(block) for block in blocks]
    if left:
        outputs[-1] = outputs[-1][:left]
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


class _TritonRMSNorm(torch.autograd.Function):
    """RMSNorm of ``rows [N, D]`` on :mod:`._triton`'s kernels: fp32 math, one rounding to ``out_dtype``; the weight's
    gradient summed in fp32 over the backward's programs."""

    @staticmethod
    def forward(ctx, rows, weight, eps, offset, out_dtype):
        from . import _triton

        rows = rows.contiguous()
        N, D = rows.shape
        BD, BT, warps = _norm_blocks(D)
        y = torch.empty(N, D, dtype=out_dtype, device=rows.device)
        rstd = torch.empty(N, dtype=torch.float32, device=rows.device)
        if N:
            _triton.rms_norm_fwd_kernel[(-(-N // BT),)](rows, weight, y, rstd, N, D, eps, OFFSET=offset, BT=BT,
                                                       BD=BD, num_warps=warps)
        ctx.save_for_backward(rows, weight, rstd)
        ctx.offset = offset
        return y

    @staticmethod
    def backward(ctx, dy):
        from . import _triton

        rows, weight, rstd = ctx.saved_tensors
        N, D = rows.shape
        BD, BT, warps = _norm_blocks(D)
        dy = dy.contiguous()
        dx = torch.empty_like(rows)
        programs = max(1, min(_backward_programs(rows.device), -(-N // BT)))
        partial = torch.zeros(programs, D, dtype=torch.float32, device=rows.device)
        if N:
            _triton.rms_norm_bwd_kernel[(programs,)](rows, weight, rstd, dy, dx, partial, N, D, programs,
                                                     OFFSET=ctx.offset, BT=BT, BD=BD, num_warps=warps)
        return dx, partial.sum(0).to(weight.dtype), None, None, None


def _norm_blocks(D: int) -> tuple[int, int, int]:
    """(columns per block: D to a power of two; rows per program; warps) for :class:`_TritonRMSNorm`."""
    BD = 1 << max(D - 1, 0).bit_length()
    BT = max(1, min(32, 4096 // BD))
    return BD, BT, 8 if BD * BT >= 4096 else 4


def _backward_programs(device: torch.device) -> int:
    """Programs of the RMSNorm backward: four per streaming multiprocessor (a fixed count: not a function of the
    row count, so nothing compiles per forest size; each program sums its rows' share of the weight gradient)."""
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def relu_squared(x: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """``relu(x) ** 2`` in ``x``'s dtype, on harts_hf's Triton kernels (:mod:`._triton`) when ``backend`` resolves to
    ``"fla"``: one read and one write forward, fp32 math rounded once, the backward ``2 relu(x) dy`` the same way.
    Under CUDA autocast the reference squares in fp32 and the next matrix product rounds that to bf16, and its
    backward rounds ``2 relu(x) dy`` from fp32 once: the kernel gives the product the same bf16 values (the square of
    a bf16 number is exact in fp32) without the fp32 copies, about 0.33 of 3.72 s on the Nemotron-H-shaped preset's
    full-size ``tau`` (H100, 2026-12-05). fla's ``sqrelu`` goes through ``torch.compile``, which the CPU checks under
    Triton's interpreter cannot run; this kernel is two loads and a store."""
    if token_ops_backend(x, backend) == "torch":
        return relu_squared_reference(x)
    return _TritonReluSquared.apply(x)


_RELU_BLOCK = 4096


class _TritonReluSquared(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        from . import _triton

        x = x.contiguous()
        y = torch.empty_like(x)
        if x.numel():
            _triton.relu_squared_fwd_kernel[(-(-x.numel() // _RELU_BLOCK),)](x, y, x.numel(), B=_RELU_BLOCK)
        ctx.save_for_backward(x)
        return y

    @staticmethod
    def backward(ctx, dy):
        from . import _triton

        (x,) = ctx.saved_tensors
        dy = dy.contiguous()
        dx = torch.empty_like(x)
        if x.numel():
            _triton.relu_squared_bwd_kernel[(-(-x.numel() // _RELU_BLOCK),)](x, dy, dx, x.numel(), B=_RELU_BLOCK)
        return dx


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """``silu(gate) * up`` (same shapes), on fla's kernel when ``backend`` resolves to ``"fla"``."""
    if token_ops_backend(gate, backend) == "torch":
        return swiglu_reference(gate, up)
    return _fla()[1](gate, up)


def kda_gate(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, *, lower_bound: float | None = None,
             out_dtype: torch.dtype = torch.float32, backend: str | None = None) -> torch.Tensor:
    """Kimi Delta Attention's forget gate of :func:`~.naive.kda_gate_reference` (``f [..., H, K]``), on fla's fused
    kernel (``fused_kda_gate``: one read of ``f`` and one write of the decay, the gradients of ``f``, ``A_log`` and
    ``dt_bias`` in one pass back) when ``backend`` resolves to ``"fla"``; transformers computes it in five to seven
    full-size fp32 passes each way."""
    if token_ops_backend(f, backend) == "torch":
        return kda_gate_reference(f, A_log, dt_bias, lower_bound=lower_bound, out_dtype=out_dtype)
    from fla.ops.kda.gate import fused_kda_gate

    return fused_kda_gate(f, A_log, dt_bias, lower_bound=lower_bound, output_dtype=out_dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, *, activation: str = "silu",
                   fp32: bool = False, backend: str | None = None) -> torch.Tensor:
    """The gated RMSNorm of :func:`~.naive.gated_rms_norm_reference` (``x``, ``gate`` ``[..., D]``), on fla's
    fused kernel when ``backend`` resolves to ``"fla"``."""
    if token_ops_backend(x, backend) == "torch":
        return gated_rms_norm_reference(x, gate, weight, eps, activation=activation, fp32=fp32)
    fla_rms_norm_gated = _fla()[2]
    rows, gates = x.reshape(-1, x.shape[-1]), gate.reshape(-1, x.shape[-1])
    norm = functools.partial(fla_rms_norm_gated, weight=weight, bias=None,
                             activation={"silu": "swish", "sigmoid": "sigmoid"}[activation], eps=eps)
    y = in_row_blocks(norm, rows, gates)  # the gated kernels autotune per ceil(rows / 65536): one block shape
    return y.reshape(x.shape).to(x.dtype)


def group_gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int, *,
                         backend: str | None = None) -> torch.Tensor:
    """Mamba-2's gated norm of :func:`~.naive.group_gated_rms_norm_reference` (``x``, ``gate`` ``[..., D]``, groups of
    ``group_size`` channels), on harts_hf's Triton kernels (:mod:`._triton`) when ``backend`` resolves to ``"fla"``
    and ``D`` and ``group_size`` are powers of two (else the reference): the gate, the per-group norm and the weight
    in one pass each way, fp32 math, ``x_hat`` rounded to ``x``'s dtype as transformers rounds it. fla's fused gated
    norm normalises whole rows after the gate, not groups of the gated input."""
    D = x.shape[-1]
    power = D & (D - 1) == 0 and group_size & (group_size - 1) == 0 and D % group_size == 0
    if token_ops_backend(x, backend) == "torch" or not power:
        return group_gated_rms_norm_reference(x, gate, weight, eps, group_size)
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    y = _TritonGroupGatedNorm.apply(x.reshape(-1, D), gate.reshape(-1, D), weight, eps, group_size,
                                    out_dtype)
    return y.reshape(x.shape)


class _TritonGroupGatedNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, gates, weight, eps, group_size, out_dtype):
        from . import _triton

        rows, gates = rows.contiguous(), gates.contiguous()
        N, D = rows.shape
        BT, warps = _group_norm_blocks(D)
        y = torch.empty(N, D, dtype=out_dtype, device=rows.device)
        rstd = torch.empty(N, D // group_size, dtype=torch.float32, device=rows.device)
        if N:
            _triton.group_gated_norm_fwd_kernel[(-(-N // BT),)](rows, gates, weight, y, rstd, N, eps,
                                                               G=D // group_size, S=group_size, BT=BT, num_warps=warps)
        ctx.save_for_backward(rows, gates, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        from . import _triton

        rows, gates, weight, rstd = ctx.saved_tensors
        (N, D), G = rows.shape, rstd.shape[1]
        BT, warps = _group_norm_blocks(D)
        dy = dy.contiguous()
        dx, dz = torch.empty_like(rows), torch.empty_like(gates)
        programs = max(1, min(_backward_programs(rows.device), -(-N // BT)))
        partial = torch.zeros(programs, D, dtype=torch.float32, device=rows.device)
        if N:
            _triton.group_gated_norm_bwd_kernel[(programs,)](rows, gates, weight, rstd, dy, dx, dz, partial, N,
                                                             programs, G=G, S=D // G, BT=BT, num_warps=warps)
        return dx, dz, partial.sum(0).to(weight.dtype), None, None, None


def _group_norm_blocks(D: int) -> tuple[int, int]:
    """(rows per program, warps) of the grouped gated norm's kernels for rows of ``D`` (a power of two) channels."""
    return max(1, 4096 // D), 8 if D >= 2048 else 4
