"""A tree node's forward or backward body as a CUDA graph, captured once per plan and replayed by every layer.

A small forest leaves the GPU waiting for the host: the Gated DeltaNet node alone spends milliseconds of Python and
launches per call around under a millisecond of kernels (BENCHMARKS.md, the host floor). Its body, though, is the
same sequence of kernels on the same shapes for every layer of a forward, every checkpoint rerun and every backward
of one plan: only the input tensors differ. :func:`replay_or_run` records the body once per plan and key as a CUDA
graph with its own input buffers, and from then on copies the inputs in, replays the graph and copies the outputs
out (a later replay overwrites the graph's buffers, and autograd keeps what a node saves).

Per plan and key: the first call runs eagerly (it also compiles and autotunes the kernels for these shapes, which a
capture must not), the second records the graph and replays it, later calls replay it. The arithmetic is the eager
body's, kernel for kernel, so results are bit-identical (checked on the H200 by ``benchmarks/gpu_kernels.py``'s
parity step). A body that cannot be recorded (a host read or a device sync inside it) runs eagerly from then on,
logged once. Graphs and their memory live in the plan's cache and go with it.

:data:`MAX_TOKENS` bounds the forests graphed (the graph's buffers hold the body's intermediates for as long as the
plan lives); 0 turns graphs off. CPU tensors, and calls made while another capture is under way, always run eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from ._backend import _log_once

__all__ = ["MAX_TOKENS", "replay_or_run"]

MAX_TOKENS = 16384
"""Largest number of executed tokens (a plan's rows, replays included) whose node bodies are graphed; 0: never. A
graph's memory stays reserved while its plan lives: at 16k tokens and the 2B preset's shapes about 1 GiB for the
Gated DeltaNet node's forward and backward together."""

_SEEN, _EAGER = "seen", "eager"


class _Graph:
    """``body`` recorded on copies of ``args`` (tensors or None); calling it copies new inputs in, replays and returns
    copies of the outputs (a tuple of tensors or None)."""

    def __init__(self, body: Callable, args: tuple):
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        self.inputs = tuple(torch.empty_like(a, memory_format=torch.contiguous_format).copy_(a)
                            if isinstance(a, torch.Tensor) else a for a in args)
        self.graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            self.graph.capture_begin(capture_error_mode="thread_local")
            try:
                outputs = body(*self.inputs)
            finally:
                self.graph.capture_end()
        torch.cuda.current_stream(device).wait_stream(stream)
        self.outputs = tuple(outputs)

    def __call__(self, args: tuple) -> tuple:
        for buffer, a in zip(self.inputs, args):
            if isinstance(buffer, torch.Tensor):
                buffer.copy_(a)
        self.graph.replay()
        return tuple(None if o is None else o.clone() for o in self.outputs)


def _signature(args: tuple) -> tuple:
    return tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a for a in args)


def replay_or_run(plan, key: tuple, tokens: int, body: Callable, args: tuple) -> tuple:
    """``body(*args)`` (a tuple of tensors or None; ``args`` tensors or None, on one device), through a CUDA graph
    cached on ``plan`` under ``key`` and the arguments' shapes and dtypes when the inputs are on CUDA and ``tokens``
    (the rows the body runs) is at most :data:`MAX_TOKENS`; ``key`` must name everything else the body depends on."""
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if (first is None or not first.is_cuda or not 0 < tokens <= MAX_TOKENS
            or torch.cuda.is_current_stream_capturing()):
        return tuple(body(*args))
    cache = plan.__dict__.setdefault("_cuda_graphs", {})
    full_key = (key, _signature(args), first.device.index)
    entry = cache.get(full_key)
    if entry is None or entry == _EAGER:
        if entry is None:
            cache[full_key] = _SEEN
        return tuple(body(*args))
    if entry == _SEEN:
        try:
            entry = cache[full_key] = _Graph(body, args)
        except Exception as error:  # noqa: BLE001 - anything a capture refuses: run eagerly from now on
            cache[full_key] = _EAGER
            _log_once(f"harts_hf: a tree node's body could not be recorded as a CUDA graph ({key[0]}: {error}); "
                      "it runs eagerly", logging.WARNING)
            return tuple(body(*args))
    return entry(args)
