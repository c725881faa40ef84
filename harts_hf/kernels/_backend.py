"""Backend choice shared by the tree kernels: CPU tensors always take the PyTorch path."""

from __future__ import annotations

import importlib.util

import torch

_BACKENDS = ("auto", "torch", "fla")


def fla_available() -> bool:
    """True when fla and triton can be imported (checked without importing them)."""
    return importlib.util.find_spec("fla") is not None and importlib.util.find_spec("triton") is not None


def resolve_backend(backend: str, tensor: torch.Tensor, op: str) -> str:
    """Pick the implementation of ``op`` for ``tensor``: ``"auto"`` -> ``"fla"`` on CUDA with fla, else ``"torch"``."""
    if backend not in _BACKENDS:
        raise ValueError(f"{op}: backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "fla" if tensor.is_cuda and fla_available() else "torch"
    if backend == "fla" and not tensor.is_cuda:
        raise ValueError(f"{op}: backend='fla' runs Triton kernels and needs CUDA tensors; got {tensor.device}. "
                         "Use backend='torch' (or 'auto') on CPU.")
    if backend == "fla" and not fla_available():
        raise ImportError(f"{op}: backend='fla' needs flash-linear-attention (fla-core) and triton: "
                          "pip install 'flash-linear-attention>=0.6,<0.7' triton")
    return backend
