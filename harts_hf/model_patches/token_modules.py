"""Per-token modules of a patched model on fused CUDA kernels (:mod:`harts_hf.kernels.token_ops`).

RMSNorms, gated RMSNorms (Mamba-2's grouped one too), SwiGLU MLPs and squared-ReLU MLPs are recognised by what they
compute, not by their class alone: at patch time each candidate (class name ending in ``RMSNorm`` / ``RMSNormGated``; a module with ``gate_proj``,
``up_proj``, ``down_proj`` and an ``act_fn`` that computes SiLU; one with ``up_proj``, ``down_proj``, no ``gate_proj``
and an ``act_fn`` that computes ``relu(x) ** 2``, Nemotron-H's) runs its own forward once on a small random input, and
it is fused only if a reference formula reproduces that output and its dtype. Anything else keeps transformers' code,
which is exact on trees too (it acts on each token alone). CPU inputs, and CUDA inputs with
``token_ops.BACKEND = "torch"``, always run the original forward. Under DeepSpeed ZeRO-3 the weights are
partitioned at patch time, so nothing is fused there.

Routed experts (transformers' ``use_experts_implementation`` modules: Qwen3-MoE, Qwen3-Next, Ling 3, GLM-4 MoE and
most other MoE families) get one fix of precision rather than a kernel: their ``grouped_mm`` implementation, the
default, is not autocast-enabled and casts its input to the weights' dtype, so with fp32 weights under bf16 autocast
(mixed-precision training) every routed expert ran in fp32 while every ``nn.Linear`` ran in bf16 (on CUDA, in
torch's per-expert fallback rather than its grouped bf16 kernel). Under autocast the grouped products inside the call
take their operands in the autocast dtype (:data:`AUTOCAST_EXPERTS`), which is what autocast does for a linear layer;
gradients reach the fp32 weights through the cast. The cast is made where the product is called, not on the
parameters, so it holds whatever the weights are by then: PEFT LoRA on the experts' parameters
(``LoraConfig(target_parameters=...)``, which adds its update to them inside the call) included.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from ..kernels import token_ops
from ..kernels.token_ops import (
    gated_rms_norm_reference,
    group_gated_rms_norm_reference,
    relu_squared_reference,
    rms_norm_reference,
)
from .core import PatchedForward, autocast_copies

__all__ = ["token_module_forwards"]

logger = logging.getLogger("harts_hf")

AUTOCAST_EXPERTS = "cuda"
"""Where routed experts on transformers' ``grouped_mm`` run in the autocast dtype under autocast (see the module
doc): ``"cuda"`` (the default: CUDA inputs; CPU runs keep transformers' code), ``"always"`` or ``"never"``
(transformers' behaviour: experts in their weights' dtype)."""
_AUTOCAST_EXPERTS = ("cuda", "always", "never")


def token_module_forwards(model: torch.nn.Module):
    """Yield ``(module, {"forward": PatchedForward})`` for every per-token module of ``model`` with a fused
    equivalent (see the module doc)."""
    from .core import zero3_enabled

    if zero3_enabled():
        return
    for name, module in model.named_modules():
        handler = _handler_for(module)
        if handler is not None:
            logger.debug("harts_hf: %s (%s) runs on fused kernels on CUDA", name, type(module).__name__)
            yield module, {"forward": PatchedForward(module, module.forward, handler)}


def _handler_for(module: torch.nn.Module):
    class_name = type(module).__name__
    try:
        if class_name.endswith("RMSNorm"):
            variant = _norm_variant(module)
            return None if variant is None else functools.partial(_norm_call, *variant)
        if class_name.endswith("RMSNormGated"):
            variant = _gated_norm_variant(module)
            if variant is not None:
                return functools.partial(_gated_norm_call, *variant)
            return _group_gated_norm_call if _is_group_gated_norm(module) else None
        if _is_swiglu_mlp(module):
            return _mlp_call
        if _is_relu_squared_mlp(module):
            return _relu_squared_mlp_call
        if _is_routed_experts(module):
            return _experts_call
    except Exception as error:  # noqa: BLE001 - a module the probe cannot run (sharded, meta) stays as it is
        logger.debug("harts_hf: %s not fused (%s)", class_name, error)
    return None


def _eps(module) -> float | None:
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return eps if isinstance(eps, float) else None


def _norm_weight(module) -> torch.Tensor | None:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.nn.Parameter) or weight.dim() != 1 or weight.numel() == 0 or weight.is_meta:
        return None
    if getattr(module, "bias", None) is not None or _eps(module) is None or list(module.children()):
        return None
    return weight


def _probe_input(weight: torch.Tensor, rows: int = 3, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, weight.shape[-1], generator=generator).to(weight.device)


def _matches(got: torch.Tensor, expected: torch.Tensor) -> bool:
    return got.dtype == expected.dtype and got.shape == expected.shape and torch.allclose(
        got.float(), expected.float(), rtol=1e-5, atol=1e-6)


_NORM_VARIANTS = ((True, True), (False, False), (False, True))
"""``(offset, fp32_weight)`` of :func:`~harts_hf.kernels.token_ops.rms_norm_reference`: Qwen3-Next's ``1 + w``,
Llama's ``w * x_hat.to(x.dtype)``, Nemotron-H's ``(w * x_hat).to(x.dtype)`` in fp32."""


def _reproduced(candidates: tuple, forward, reference, weight: torch.Tensor, inputs: int):
    """The first of ``candidates`` for which ``reference(*probes, candidate)`` reproduces ``forward(*probes)`` (values
    and dtype) on ``inputs`` random probe tensors in fp32 and again in bf16, where the variants round differently;
    ``None`` if none does."""
    left = list(candidates)
    with torch.no_grad(), torch.autocast(weight.device.type, enabled=False):
        for dtype in (torch.float32, torch.bfloat16):
            probes = [_probe_input(weight, seed=i).to(dtype) for i in range(inputs)]
            got = forward(*probes)
            left = [c for c in left if _matches(got, reference(*probes, c))]
    return left[0] if left else None


def _norm_variant(module) -> tuple[bool, bool] | None:
    """``(offset, fp32_weight)`` of the formula the module's forward computes, or ``None`` (not a fusable
    RMSNorm)."""
    weight = _norm_weight(module)
    if weight is None:
        return None
    eps = _eps(module)
    return _reproduced(_NORM_VARIANTS, module.forward, lambda x, v: rms_norm_reference(
        x, weight, eps, offset=v[0], fp32_weight=v[1]), weight, inputs=1)


_GATED_NORM_VARIANTS = (("silu", False), ("silu", True), ("sigmoid", True))
"""``(activation, fp32)`` of :func:`~harts_hf.kernels.token_ops.gated_rms_norm_reference`: Qwen3-Next's gated norm,
and the all-fp32 form of Kimi Linear / Ling 3 (sigmoid gate) or SiLU."""


def _gated_norm_variant(module) -> tuple[str, bool] | None:
    """``(activation, fp32)`` of the formula the gated norm's forward computes, or ``None`` (another formula, such as
    Mamba-2's grouped norm of the gated input: :func:`_is_group_gated_norm`)."""
    weight = _norm_weight(module)
    if weight is None:
        return None
    eps = _eps(module)
    return _reproduced(_GATED_NORM_VARIANTS, module.forward, lambda x, gate, v: gated_rms_norm_reference(
        x, gate, weight, eps, activation=v[0], fp32=v[1]), weight, inputs=2)


def _is_group_gated_norm(module) -> bool:
    """Mamba-2's gated norm: the gated input normalised per group of ``module.group_size`` channels."""
    weight, group_size = _norm_weight(module), getattr(module, "group_size", None)
    if weight is None or not isinstance(group_size, int) or group_size <= 0 or weight.shape[0] % group_size:
        return False
    eps = _eps(module)
    return _reproduced((group_size,), module.forward, lambda x, gate, size: group_gated_rms_norm_reference(
        x, gate, weight, eps, size), weight, inputs=2) is not None


def _linear_weight(linear) -> torch.Tensor | None:
    """A projection's ``[out, in]`` weight to size the probe by, or None (missing, empty or on the meta device)."""
    weight = getattr(linear, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.numel() == 0 or weight.is_meta:
        return None
    return weight


def _is_swiglu_mlp(module) -> bool:
    parts = [getattr(module, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    act_fn = getattr(module, "act_fn", None)
    if not all(isinstance(part, torch.nn.Module) for part in parts) or not callable(act_fn):
        return False
    weight = _linear_weight(parts[0])
    if weight is None:
        return False
    gate, up, down = parts
    with torch.no_grad(), torch.autocast(weight.device.type, enabled=False):
        x = _probe_input(weight).to(weight.dtype)
        return _matches(act_fn(x), F.silu(x)) and _matches(module.forward(x), down(F.silu(gate(x)) * up(x)))


def _is_relu_squared_mlp(module) -> bool:
    up, down = (getattr(module, name, None) for name in ("up_proj", "down_proj"))
    act_fn = getattr(module, "act_fn", None)
    if hasattr(module, "gate_proj") or not all(isinstance(part, torch.nn.Module) for part in (up, down)) or \
            not callable(act_fn):
        return False
    weight = _linear_weight(up)
    if weight is None:
        return False
    with torch.no_grad(), torch.autocast(weight.device.type, enabled=False):
        x = _probe_input(weight).to(weight.dtype)
        return _matches(act_fn(x), relu_squared_reference(x)) and _matches(
            module.forward(x), down(relu_squared_reference(up(x))))


def _one_tensor(args, kwargs) -> bool:
    return len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor)


def _norm_call(offset: bool, fp32_weight: bool, module, original, *args, **kwargs):
    if not _one_tensor(args, kwargs) or token_ops.token_ops_backend(args[0]) == "torch":
        return original(*args, **kwargs)
    return token_ops.rms_norm(args[0], module.weight, _eps(module), offset=offset, fp32_weight=fp32_weight,
                              backend="fla")


def _gated_norm_call(activation: str, fp32: bool, module, original, *args, **kwargs):
    if len(args) != 2 or kwargs or token_ops.token_ops_backend(args[0]) == "torch":
        return original(*args, **kwargs)
    return token_ops.gated_rms_norm(args[0], args[1], module.weight, _eps(module), activation=activation, fp32=fp32,
                                    backend="fla")


def _mlp_call(module, original, *args, **kwargs):
    if not _one_tensor(args, kwargs) or token_ops.token_ops_backend(args[0]) == "torch":
        return original(*args, **kwargs)
    x = args[0]
    x_gate, x_up = autocast_copies(x, 2, through=(module.gate_proj, module.up_proj))  # SHARED_CASTS: one cast
    return module.down_proj(token_ops.swiglu(module.gate_proj(x_gate), module.up_proj(x_up), backend="fla"))


def _group_gated_norm_call(module, original, *args, **kwargs):
    if len(args) != 2 or kwargs or not isinstance(args[1], torch.Tensor) or \
            token_ops.token_ops_backend(args[0]) == "torch":
        return original(*args, **kwargs)
    return token_ops.group_gated_rms_norm(args[0], args[1], module.weight, _eps(module), module.group_size,
                                          backend="fla")


def _relu_squared_mlp_call(module, original, *args, **kwargs):
    if not _one_tensor(args, kwargs) or token_ops.token_ops_backend(args[0]) == "torch":
        return original(*args, **kwargs)
    return module.down_proj(token_ops.relu_squared(module.up_proj(args[0]), backend="fla"))


def _is_routed_experts(module) -> bool:
    """A routed-experts module of transformers' ``use_experts_implementation`` (its forward dispatches on
    ``config._experts_implementation``; expert weights stacked ``[experts, ...]`` as its own parameters)."""
    forward = getattr(type(module).forward, "__wrapped__", None)
    implementation = getattr(getattr(module, "config", None), "_experts_implementation", None)
    return forward is not None and isinstance(implementation, str) and all(
        hasattr(module, name) for name in ("has_gate", "has_bias", "is_transposed")) and any(
        p.dim() == 3 for p in module.parameters(recurse=False))


def _experts_call(module, original, *args, **kwargs):
    if AUTOCAST_EXPERTS not in _AUTOCAST_EXPERTS:
        raise ValueError(f"token_modules.AUTOCAST_EXPERTS must be one of {_AUTOCAST_EXPERTS}, got {AUTOCAST_EXPERTS!r}")
    x = args[0] if args else kwargs.get("hidden_states")
    if AUTOCAST_EXPERTS == "never" or not isinstance(x, torch.Tensor) or (AUTOCAST_EXPERTS == "cuda" and not x.is_cuda):
        return original(*args, **kwargs)
    return experts_in_autocast_dtype(module, original, x.device.type, *args, **kwargs)


def experts_in_autocast_dtype(module, original, device_type: str, *args, **kwargs):
    """``original(*args, **kwargs)`` (the experts module's forward) with torch's grouped matrix products inside it
    taking operands wider than the autocast dtype of ``device_type`` in that dtype, where autocast is on there and the
    module runs transformers' ``grouped_mm`` (its ``eager`` and ``batched_mm`` forms use autocast-enabled ops
    already)."""
    if module.config._experts_implementation != "grouped_mm" or not torch.is_autocast_enabled(device_type):
        return original(*args, **kwargs)
    with _GroupedProductsIn(torch.get_autocast_dtype(device_type)):
        return original(*args, **kwargs)


class _GroupedProductsIn(torch.overrides.TorchFunctionMode):
    """Within it (this thread only), ``torch._grouped_mm``, which ``F.grouped_mm`` and transformers' experts call,
    takes its two operands in ``dtype`` where they are wider floating-point tensors; every other call is unchanged."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) == "_grouped_mm" and len(args) >= 2:
            args = (*(self._narrow(x) for x in args[:2]), *args[2:])
        return func(*args, **(kwargs or {}))

    def _narrow(self, x):
        wide = isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype.itemsize > self.dtype.itemsize
        return x.to(self.dtype) if wide else x
