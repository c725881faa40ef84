"""``logprob_entropy``: per-row log-prob of the label and entropy of ``softmax(logits / T)``.

On CUDA the fused path (:mod:`._triton`) reads the ``[N, V]`` logits once forward and once backward in their own
dtype (bf16 under autocast) and writes the logits' gradient directly; the reference formula materialises fp32
copies of the logits, their log-softmax and its exponent (~10 passes over fp32 ``[N, V]`` per call with its
backward). CPU tensors always take the reference.
"""

from __future__ import annotations

import importlib.util

import torch

from .naive import logprob_entropy_reference

__all__ = ["BACKEND", "logprob_entropy", "logprob_stats_backend"]

BACKEND = "auto"
"""``"auto"``: the fused Triton path for CUDA tensors when triton imports, the reference otherwise; ``"torch"``:
always the reference (benchmarks' A/B); ``"triton"``: always fused (CUDA, or CPU under Triton's interpreter)."""

_BLOCK = 4096
_NUM_WARPS = 8


def logprob_stats_backend(logits: torch.Tensor, choice: str | None = None) -> str:
    """``"triton"`` or ``"torch"`` for ``logits`` under ``choice`` (default :data:`BACKEND`)."""
    choice = BACKEND if choice is None else choice
    if choice not in ("auto", "torch", "triton"):
        raise ValueError(f"logprob_entropy: backend must be 'auto', 'torch' or 'triton', got {choice!r}")
    if choice == "auto":
        return "triton" if logits.is_cuda and importlib.util.find_spec("triton") is not None else "torch"
    return choice


class _LogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, temperature: float):
        from . import _triton

        logits = logits if logits.stride(-1) == 1 else logits.contiguous()
        N, V = logits.shape
        lse, logprobs, entropies = (torch.empty(N, device=logits.device, dtype=torch.float32) for _ in range(3))
        top1 = torch.empty(N, device=logits.device, dtype=torch.int8)
        if N:
            _triton.stats_kernel[(N,)](logits, labels, lse, logprobs, entropies, top1, logits.stride(0), V,
                                       1.0 / temperature, BV=_BLOCK, num_warps=_NUM_WARPS)
        ctx.save_for_backward(logits, labels, lse, entropies)
        ctx.temperature = temperature
        top1 = top1.bool()
        ctx.mark_non_differentiable(lse, top1)
        return logprobs, entropies, lse, top1

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropies, _grad_lse, _grad_top1):
        from . import _triton

        logits, labels, lse, entropies = ctx.saved_tensors
        N, V = logits.shape
        grad_logits = torch.empty_like(logits)
        if grad_logprobs is None:
            grad_logprobs = torch.zeros_like(lse)
        has_entropy = grad_entropies is not None
        if N:
            _triton.grad_kernel[(N, -(-V // _BLOCK))](
                logits, grad_logits, labels, lse, entropies, grad_logprobs.float().contiguous(),
                grad_entropies.float().contiguous() if has_entropy else grad_logprobs, logits.stride(0),
                grad_logits.stride(0), V, 1.0 / ctx.temperature, HAS_ENTROPY=has_entropy, BV=_BLOCK,
                num_warps=_NUM_WARPS)
        return grad_logits, None, None


def logprob_entropy(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, *,
                    backend: str | None = None, return_top1: bool = False) -> tuple[torch.Tensor, ...]:
    """``logits [N, V]`` (fp32/bf16/fp16), ``labels [N]`` long -> fp32 ``logprobs [N]`` and ``entropies [N]`` of
    ``softmax(logits / temperature)``, differentiable in ``logits`` through both outputs; with ``return_top1`` also
    ``top1 [N]`` bool: the label is the row's argmax (its first maximum, as ``torch.argmax``). ``backend``: see
    :data:`BACKEND`. A label outside ``[0, V)`` gives a NaN log-prob on the fused path (the reference raises)."""
    if logits.dim() != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(f"logprob_entropy: logits must be [N, V] and labels [N]; got logits {tuple(logits.shape)}, "
                         f"labels {tuple(labels.shape)}")
    if logprob_stats_backend(logits, backend) == "torch":
        picked, entropy = logprob_entropy_reference(logits, labels, temperature)
        return (picked, entropy, logits.argmax(-1) == labels) if return_top1 else (picked, entropy)
    logprobs, entropies, _, top1 = _LogprobEntropy.apply(logits, labels, float(temperature))
    return (logprobs, entropies, top1) if return_top1 else (logprobs, entropies)
