"""Keep CPU tensors away from Triton in the models harts_hf patches.

When fla (or causal-conv1d) imports, which it does wherever triton is installed, transformers binds their Triton
kernels into the Gated DeltaNet layers at import time, whatever device the model later runs on; a CPU forward
(``generate`` included) then fails inside Triton ("0 active drivers"). :func:`cpu_guard_attributes` gives every
mixer that can reach such a kernel an instance ``forward`` that, for CPU inputs, runs the mixer with its module's
kernel functions (transformers >= 5.2x: module globals wrapped by ``use_kernel_func_from_hub_with_fallback``;
older releases: instance attributes such as ``chunk_gated_delta_rule``) set to their pure-PyTorch versions for the
duration of the call. CUDA inputs run untouched. transformers >= 5.25 sends CPU inputs to the PyTorch version
itself, so there the guard only makes explicit what transformers would pick; :func:`kernel_fallbacks` also serves
references that want the PyTorch kernels on CUDA (:func:`harts_hf.reference.torch_reference_kernels`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys

import torch

__all__ = ["cpu_guard_attributes", "kernel_fallbacks", "torch_function_of", "torch_kernels_for"]

# instance attributes older transformers releases bind (fla / causal-conv1d function, or None) and the module
# global holding the pure-PyTorch version (None: the layer's own fallback when the attribute is None)
_INSTANCE_KERNELS = {
    "chunk_gated_delta_rule": "torch_chunk_gated_delta_rule",
    "recurrent_gated_delta_rule": "torch_recurrent_gated_delta_rule",
    "causal_conv1d_fn": None,
    "causal_conv1d_update": "torch_causal_conv1d_update",
}
_TRITON_PACKAGES = ("fla", "causal_conv1d", "mamba_ssm")


def _from_triton_package(function) -> bool:
    module = getattr(function, "__module__", None) or ""
    return module.split(".")[0] in _TRITON_PACKAGES


def _hub_wrapper(value):
    """The function transformers' ``use_kernel_func_from_hub_with_fallback`` made of a kernel function, as
    ``value`` holds it: the function itself, or (transformers >= 5.25, where the ``kernels`` package is a
    dependency) inside the ``Func`` module ``kernels`` wraps it in; None for anything else."""
    if isinstance(value, torch.nn.Module):
        value = _func_module_callee(type(value))
    code = getattr(value, "__code__", None)
    return value if code is not None and code.co_filename.endswith("hub_kernels.py") else None


@functools.cache
def _func_module_callee(module_type):
    """What a ``kernels`` Func module's forward calls (a closure variable of the class's forward), else None."""
    forward = module_type.forward
    return inspect.getclosurevars(forward).nonlocals.get("func") if hasattr(forward, "__code__") else None


def torch_function_of(value):
    """The pure-PyTorch function behind a kernel function transformers wrapped (:func:`_hub_wrapper`), or None."""
    wrapper = _hub_wrapper(value)
    return None if wrapper is None else getattr(wrapper, "__wrapped__", None)


def kernel_fallbacks(python_module) -> dict:
    """``{global name: pure-PyTorch function}`` for the module globals of ``python_module`` that transformers bound
    to a kernel package now (its ``use_kernel_func_from_hub_with_fallback`` wrappers whose implementation is not
    the torch function; a global already set to a PyTorch function, e.g. by a reference run, is left alone)."""
    fallbacks = {}
    for name, value in vars(python_module).items():
        wrapper = _hub_wrapper(value)
        if wrapper is not None:
            torch_function = _torch_version(wrapper)
            if torch_function is not None:
                fallbacks[name] = torch_function
    return fallbacks


@functools.cache
def _torch_version(wrapper):
    captured = inspect.getclosurevars(wrapper).nonlocals
    return captured.get("torch_function") if captured.get("is_new_implementation") else None


def _instance_fallbacks(module) -> dict:
    """``{attribute: pure-PyTorch value}`` for kernel functions bound on the mixer instance itself."""
    python_module = sys.modules[type(module).__module__]
    fallbacks = {}
    for attribute, torch_name in _INSTANCE_KERNELS.items():
        if _from_triton_package(vars(module).get(attribute)):
            fallbacks[attribute] = None if torch_name is None else getattr(python_module, torch_name)
    return fallbacks


@contextlib.contextmanager
def torch_kernels_for(module):
    """Within the block, ``module``'s (a mixer instance) kernel functions are their pure-PyTorch versions."""
    python_module = sys.modules[type(module).__module__]
    saved = [(python_module, name, getattr(python_module, name), fallback)
             for name, fallback in kernel_fallbacks(python_module).items()]
    saved += [(module, name, vars(module)[name], fallback) for name, fallback in _instance_fallbacks(module).items()]
    try:
        for owner, name, _, fallback in saved:
            setattr(owner, name, fallback)
        yield
    finally:
        for owner, name, current, _ in reversed(saved):
            setattr(owner, name, current)


def _uses_kernels(module) -> bool:
    if _instance_fallbacks(module):
        return True
    bound = kernel_fallbacks(sys.modules[type(module).__module__])
    code = getattr(inspect.unwrap(type(module).forward), "__code__", None)
    return bool(bound) and code is not None and not bound.keys().isdisjoint(code.co_names)


def _triton_modules(module) -> list[str]:
    return [type(child).__module__ for child in module.children() if _from_triton_package(type(child))]


def _guarded_call(module, original, *args, **kwargs):
    tensor = next((value for value in (*args, *kwargs.values()) if isinstance(value, torch.Tensor)), None)
    if tensor is None or tensor.is_cuda:
        return original(*args, **kwargs)
    triton_children = _triton_modules(module)
    if triton_children:
        raise RuntimeError(
            f"{type(module).__name__} holds Triton-only modules ({', '.join(triton_children)}) and got CPU tensors: "
            "this transformers release binds fla's gated norm when fla imports. Run it on CUDA, upgrade "
            "transformers (>= 5.24 keeps a PyTorch norm), or uninstall triton on this CPU machine.")
    with torch_kernels_for(module):
        return original(*args, **kwargs)


def cpu_guard_attributes(model) -> list[tuple[torch.nn.Module, dict]]:
    """``[(mixer, {"forward": guarded forward})]`` for every submodule of ``model`` whose forward can reach a
    Triton kernel bound by transformers (empty where none is bound, e.g. without triton)."""
    from .core import PatchedForward

    def guarded(module) -> bool:
        forward = vars(module).get("forward")
        return isinstance(forward, PatchedForward) and forward.handler is _guarded_call

    return [(module, {"forward": PatchedForward(module, module.forward, _guarded_call)})
            for module in model.modules() if _uses_kernels(module) and not guarded(module)]
