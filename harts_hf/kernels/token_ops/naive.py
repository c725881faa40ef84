"""References: RMSNorm in its three transformers spellings, the gated RMSNorm, SwiGLU, the squared ReLU and Kimi Delta
Attention's forget gate."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, *, offset: bool,
                       fp32_weight: bool | None = None) -> torch.Tensor:
    """RMSNorm over the last dim, computed in fp32. ``offset=True``: ``x_hat * (1 + weight)`` returned in ``x``'s
    dtype (Qwen3-Next, Qwen3.5, Gemma); ``offset=False``: ``weight * x_hat.to(x.dtype)`` (Llama, Qwen2/3: the
    result in the promoted dtype of ``weight`` and ``x``), or with ``fp32_weight=True`` ``weight * x_hat`` in fp32
    returned in ``x``'s dtype (Nemotron-H, T5). ``fp32_weight`` defaults to ``offset`` (the offset form multiplies
    in fp32)."""
    x_hat = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (x_hat * (1.0 + weight.float())).to(x.dtype)
    if fp32_weight:
        return (weight.float() * x_hat).to(x.dtype)
    return weight * x_hat.to(x.dtype)


GATE_ACTIVATIONS = {"silu": F.silu, "sigmoid": torch.sigmoid}


def gated_rms_norm_reference(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, *,
                             activation: str = "silu", fp32: bool = False) -> torch.Tensor:
    """``(weight * x_hat.to(x.dtype)) * silu(gate)`` in fp32, returned in ``x``'s dtype (the gated norm after
    Gated DeltaNet in Qwen3-Next / Qwen3.5); ``fp32=True``: ``(weight * x_hat) * activation(gate)`` all in fp32 and
    rounded once (the gated norm after Kimi Delta Attention in Kimi Linear and Ling 3, ``activation="sigmoid"``)."""
    x_hat = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    act = GATE_ACTIVATIONS[activation]
    if fp32:
        return (weight.float() * x_hat * act(gate.float())).to(x.dtype)
    return ((weight * x_hat.to(x.dtype)) * act(gate.float())).to(x.dtype)


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in the inputs' dtype."""
    return F.silu(gate) * up


def relu_squared_reference(x: torch.Tensor) -> torch.Tensor:
    """``relu(x) ** 2`` as transformers' ``ReLUSquaredActivation`` computes it (``torch.square`` of ``relu``; under
    CUDA autocast ``square`` runs in fp32)."""
    return torch.square(F.relu(x))


def group_gated_rms_norm_reference(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                                   group_size: int) -> torch.Tensor:
    """Mamba-2's gated norm (Nemotron-H, Bamba, Falcon-H1, Granite 4 hybrid): ``u = x * silu(gate)`` in fp32,
    normalised over each group of ``group_size`` channels, ``weight * x_hat.to(x.dtype)`` (the promoted dtype)."""
    u = x.float() * F.silu(gate.float())
    groups = u.view(*u.shape[:-1], u.shape[-1] // group_size, group_size)
    x_hat = (groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + eps)).view(u.shape)
    return weight * x_hat.to(x.dtype)


def kda_gate_reference(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, *,
                       lower_bound: float | None = None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Kimi Delta Attention's per-channel log decay from its projection ``f [..., H, K]``, in fp32: ``-exp(A_log) *
    softplus(f + dt_bias)`` (Kimi Linear; Ling 3 without its safe gate) or, with ``lower_bound``, Ling 3's safe gate
    ``lower_bound * sigmoid(exp(A_log) * (f + dt_bias))``; ``A_log`` holds one value per head, ``dt_bias`` one per
    channel (``H * K``). Returned in ``out_dtype``."""
    H, K = f.shape[-2:]
    x = f.float() + dt_bias.float().view(H, K)
    rate = A_log.float().reshape(H, 1).exp()
    if lower_bound is None:
        return (-rate * F.softplus(x)).to(out_dtype)
    return (lower_bound * torch.sigmoid(rate * x)).to(out_dtype)
