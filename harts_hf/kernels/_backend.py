"""Backend choice shared by the tree kernels: CPU tensors always take the PyTorch path."""

from __future__ import annotations

import functools
import importlib.util
import logging

import torch

logger = logging.getLogger("harts_hf")

_BACKENDS = ("auto", "torch", "fla")


@functools.cache
def _log_once(message: str, level: int = logging.WARNING) -> None:
    logger.log(level, message)


def fla_backward_problem(capability: tuple[int, int], triton_version: str, has_tilelang: bool) -> str | None:
    """Why fla's gated-delta-rule backward would refuse to run here, or None.

    Triton 3.4 - 3.7.0 miscompiles one of its backward kernels on Hopper (compute capability 9.x); fla then
    needs tilelang, which it uses instead.
    """
    version = tuple(int(part) for part in triton_version.split("+")[0].split(".")[:3] if part.isdigit())
    if capability[0] == 9 and (3, 4, 0) <= version < (3, 7, 1) and not has_tilelang:
        return (f"fla's gated-delta-rule backward is wrong with triton {triton_version} on Hopper (sm_90) and fla "
                "refuses it; install tilelang (pip install tilelang) or triton >= 3.7.1, or pass "
                "backend='torch' / tree_gdn_backend='torch' (slow)")
    return None


@functools.cache
def _check_fla_backward(device_index: int) -> None:
    import triton

    problem = fla_backward_problem(torch.cuda.get_device_capability(device_index), triton.__version__,
                                   importlib.util.find_spec("tilelang") is not None)
    if problem is not None:
        raise RuntimeError(problem)


def fla_available() -> bool:
    """True when fla and triton can be imported (checked without importing them)."""
    return importlib.util.find_spec("fla") is not None and importlib.util.find_spec("triton") is not None


def resolve_backend(backend: str, tensor: torch.Tensor, op: str) -> str:
    """Pick the implementation of ``op`` for ``tensor``: ``"auto"`` -> ``"fla"`` on CUDA with fla, else ``"torch"``."""
    if backend not in _BACKENDS:
        raise ValueError(f"{op}: backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "auto":
        if not tensor.is_cuda:
            _log_once("harts_hf: tree kernels on CPU tensors take the PyTorch backends", logging.INFO)
            return "torch"
        if not fla_available():
            _log_once("harts_hf: CUDA tensors but flash-linear-attention/triton are not importable; the tree "
                      "gated delta rule takes the PyTorch backend (slow). pip install 'flash-linear-attention>=0.6,<0.7'")
            return "torch"
        backend = "fla"
    if backend == "fla" and not tensor.is_cuda:
        raise ValueError(f"{op}: backend='fla' runs Triton kernels and needs CUDA tensors; got {tensor.device}. "
                         "Use backend='torch' (or 'auto') on CPU.")
    if backend == "fla" and not fla_available():
        raise ImportError(f"{op}: backend='fla' needs flash-linear-attention (fla-core) and triton: "
                          "pip install 'flash-linear-attention>=0.6,<0.7' triton")
    if backend == "fla" and tensor.requires_grad and torch.is_grad_enabled():
        _check_fla_backward(tensor.device.index if tensor.device.index is not None else torch.cuda.current_device())
    return backend


FLA_ROW_BUCKET = 2048 * 32
"""fla's row-wise norm kernels (gated RMSNorm, L2 norm) compile and autotune once per ``ceil(rows / 65536)``:
every new bucket of input size costs ~15 s of compilation the first time. :func:`in_row_blocks` keeps each call
inside the first bucket."""


def in_row_blocks(function, *tensors: torch.Tensor, rows: int | None = None):
    """``function(*tensors)`` for a ROW-WISE function, applied to consecutive blocks of at most ``rows`` leading
    rows (default :data:`FLA_ROW_BUCKET`) and concatenated; one call when everything fits. Every output is split
    like the inputs: a tensor, or a tuple of tensors with the same leading dimension."""
    rows = FLA_ROW_BUCKET if rows is None else rows
    if tensors[0].shape[0] <= rows:
        return function(*tensors)
    # split, not slicing: autograd then joins the blocks' gradients with one concatenation; a slice's backward
    # is a zero-filled full-size tensor per block, summed over blocks (quadratic: ~1.3 s of fill_ and add_ per
    # step on full-size tau, 48 blocks per call)
    parts = [function(*blocks) for blocks in zip(*(t.split(rows) for t in tensors))]
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts)
    return tuple(torch.cat(column) for column in zip(*parts))
