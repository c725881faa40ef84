"""FlashAttention-4's varlen attention as two dispatcher ops, ``harts::fa4_varlen_fwd`` and ``harts::fa4_varlen_bwd``.

``flash_attn.cute.flash_attn_varlen_func`` is an autograd function whose kernels launch outside torch's dispatcher,
so a selective-checkpointing policy never sees them and the backward's rerun recomputes the attention.
As dispatcher ops (``torch.library.custom_op``, autograd registered on the forward op) the forward is an op the
policy can keep (:mod:`harts_hf.model_patches.checkpointing`), like torch's own ``varlen_attn``. The ops call the
same two functions FlashAttention-4's autograd function calls (``_flash_attn_fwd`` / ``_flash_attn_bwd`` of
``flash_attn.cute.interface``, 4.0.0b36); :func:`check_interface` checks their signatures before first use.

Bottom-right causal (``causal=False``: no mask, for :mod:`.shared_keys`' unmasked blocks); ``window_left`` < 0 means no
window (FlashAttention-4 spells it ``None``), ``softcap`` 0 no logit softcapping, and ``sinks`` (``[HQ]`` attention-sink
logits, GPT-OSS's) is optional.
"""

from __future__ import annotations

import functools
import inspect

import torch

__all__ = ["UNPADDED_WIDTHS", "check_interface", "fa4_varlen", "takes_value_width"]

_FWD_KEYWORDS = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "softmax_scale", "causal",
                 "softcap", "window_size_left", "window_size_right", "learnable_sink", "return_lse")
_BWD_KEYWORDS = ("softmax_scale", "causal", "softcap", "window_size_left", "window_size_right", "cu_seqlens_q",
                 "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "learnable_sink")


@functools.cache
def check_interface():
    """FlashAttention-4's forward and backward functions, after checking they take every keyword used here."""
    try:
        from flash_attn.cute import interface
    except ImportError as error:
        raise ImportError("tree attention: KERNEL='fa4' needs FlashAttention-4: pip install flash-attn-4") from error
    for name, keywords in (("_flash_attn_fwd", _FWD_KEYWORDS), ("_flash_attn_bwd", _BWD_KEYWORDS)):
        function = getattr(interface, name, None)
        missing = [] if function is None else [k for k in keywords if k not in inspect.signature(function).parameters]
        if function is None or missing:
            raise ImportError(f"tree attention: flash_attn.cute.interface.{name} "
                              f"{'is missing' if function is None else 'lacks ' + ', '.join(missing)}; harts_hf's "
                              "FlashAttention-4 path was written against flash-attn-4 4.0.0b36: install that version "
                              "or set KERNEL = 'torch' (from harts_hf.kernels.tree_attention import varlen)")
    return interface._flash_attn_fwd, interface._flash_attn_bwd


UNPADDED_WIDTHS = frozenset({(192, 128)})
"""(key head dim, value head dim) pairs FlashAttention-4 gets unpadded where its own check accepts them: MLA's
(DeepSeek, Kimi, Ling), checked forward and backward against fp32 on an H100 (BENCHMARKS.md, 2026-12-07). Other pairs
keep the values zero-padded to the key width until they are checked so."""


@functools.cache
def takes_value_width(head_dim: int, value_dim: int, device_index: int) -> bool:
    """Whether FlashAttention-4 gets key heads of ``head_dim`` with value heads of ``value_dim`` as they are on the
    CUDA device ``device_index``: a pair of :data:`UNPADDED_WIDTHS` that FlashAttention-4's own head-dim check accepts
    on the device's architecture (Hopper, Blackwell). Then MLA's values need no zero padding to the key width: less to
    gather and multiply (values of 128 against 192). Otherwise False (values padded, as for torch's flash call)."""
    if (head_dim, value_dim) not in UNPADDED_WIDTHS:
        return False
    from flash_attn.cute import interface

    validate = getattr(interface, "_validate_head_dims", None)
    major = torch.cuda.get_device_capability(device_index)[0]
    if validate is None or major not in (9, 10, 11):
        return False
    try:
        validate(head_dim, value_dim, major, 8)  # 8: elements in 16 bytes of bf16 / fp16
    except AssertionError:
        return False
    return True


def _window_sizes(window_left: int) -> dict:
    """FlashAttention-4's window keywords for ``window_left`` (< 0: no window, both None)."""
    if window_left < 0:
        return dict(window_size_left=None, window_size_right=None)
    return dict(window_size_left=window_left, window_size_right=0)


@torch.library.custom_op("harts::fa4_varlen_fwd", mutates_args=())
def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int,
             max_k: int, scale: float, window_left: int, softcap: float, sinks: torch.Tensor | None,
             causal: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    forward, _ = check_interface()
    out, lse, *_ = forward(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
                           softmax_scale=scale, causal=causal, softcap=softcap or None, **_window_sizes(window_left),
                           learnable_sink=sinks, return_lse=True)
    return out, lse


@_forward.register_fake
def _(q, k, v, cu_q, cu_k, max_q, max_k, scale, window_left, softcap, sinks, causal=True):
    return q.new_empty(q.shape[:-1] + v.shape[-1:]), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("harts::fa4_varlen_bwd", mutates_args=())
def _backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              lse: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int, scale: float,
              window_left: int, softcap: float, sinks: torch.Tensor | None,
              causal: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv and the sinks' gradient (empty without sinks: an op returns tensors)."""
    _, backward = check_interface()
    grads = backward(q, k, v, out, dout.contiguous(), lse, softmax_scale=scale, causal=causal, softcap=softcap,
                     **_window_sizes(window_left), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
                     learnable_sink=sinks)
    dq, dk, dv = grads[:3]
    return dq, dk, dv, grads[3] if sinks is not None else q.new_empty(0)


@_backward.register_fake
def _(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, window_left, softcap, sinks, causal=True):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            q.new_empty(0) if sinks is None else torch.empty_like(sinks))


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, scale, window_left, softcap, sinks, *causal = inputs  # (given or default)
    causal = causal[0] if causal else True
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, sinks)
    ctx.args, ctx.causal = (max_q, max_k, scale, window_left, softcap), causal


def _autograd_backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_q, cu_k, sinks = ctx.saved_tensors
    if dout is None:  # the output fed nothing that needs a gradient
        dout = torch.zeros_like(out)
    dq, dk, dv, dsinks = _backward(dout, q, k, v, out, lse, cu_q, cu_k, *ctx.args, sinks, ctx.causal)
    return dq, dk, dv, None, None, None, None, None, None, None, None if sinks is None else dsinks, None


_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


def fa4_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int,
               max_k: int, scale: float | None = None, window: int | None = None, softcap: float | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Bottom-right causal varlen attention on FlashAttention-4 (``window``: keys less than ``window`` rows before
    the query's diagonal; ``softcap``: ``c * tanh(scores / c)``; ``sinks``: ``[HQ]`` sink logits); q ``[Tq, HQ, D]``,
    k/v ``[Tk, HKV, D]`` -> ``[Tq, HQ, D]``."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _forward(q, k, v, cu_q, cu_k, int(max_q), int(max_k), scale, -1 if window is None else window - 1,
                    float(softcap or 0.0), sinks, True)[0]
