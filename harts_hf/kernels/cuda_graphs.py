"""A tree node's forward or backward body as a CUDA graph, captured once per plan and replayed by every layer.

A small forest leaves the GPU waiting for the host: the Gated DeltaNet node alone spends milliseconds of Python and
launches per call around under a millisecond of kernels (BENCHMARKS.md, the host floor). Its body, though, is the
same sequence of kernels on the same shapes for every layer of a forward, every checkpoint rerun and every backward
of one plan: only the input tensors differ. :func:`replay_or_run` records the body once per plan and key as a CUDA
graph with its own input buffers, and from then on copies the inputs in, replays the graph and copies the outputs
out (a later replay overwrites the graph's buffers, and autograd keeps what a node saves).

Per plan and key: the first call runs eagerly (it also compiles and autotunes the kernels for these shapes, which a
capture must not), the second records the graph and replays it, later calls replay it. The arithmetic is the eager
body's, kernel for kernel: on the H200 the node's outputs, requested states and gradients were bit-identical to the
eager node's wherever two eager runs were (``benchmarks/gpu_kernels.py --parity graph``). A body that cannot be
recorded (a host read, a device sync, or no memory left) runs eagerly from then on, logged once.

Memory: each graph records into its own memory pool, which keeps the body's whole working set (its temporaries
included) reserved for as long as the graph lives: by a count of the body's tensors (not measured) about 0.1 MB per
executed row for the Gated DeltaNet node's forward and 0.25 MB for its backward at the 2B preset's shapes. At most
:data:`MAX_GRAPHS` graphs live at once (the least recently replayed one is dropped and its plan runs that body eagerly
from then on). One pool shared by every graph would keep one working set instead; tried on the H200 (2026-12-04),
torch's allocator asserted once the graphs holding the shared pool were freed, and the failed capture left the CUDA
random generator unusable for the rest of the process, so it is not used.

Off by default (:data:`MAX_TOKENS` = 0). Measured on the H200 (2026-12-04, BENCHMARKS.md): on plans of up to 16,384
rows the graphs took ``tau`` at scale 0.02 from 0.48 to 0.44 s per fwd+bwd (reserved memory 20.4 -> 23.4 GiB); with
no cap on live graphs, full-size ``tau`` cut into pieces for 8 ranks reserved 80 GiB in graph pools until captures
ran out of memory (they then ran eagerly). A capture that fails can leave torch's CUDA random generator in capture
state (seen after the allocator's assert above): opt in where bodies fit in memory. CPU tensors, and calls made while
another capture is under way, always run eagerly.
"""

from __future__ import annotations

import logging
import weakref
from collections import OrderedDict
from collections.abc import Callable

import torch

from .._checks import check_int
from ._backend import _log_once

__all__ = ["MAX_GRAPHS", "MAX_TOKENS", "eligible", "replay_or_run"]

MAX_TOKENS = 0
"""Largest number of rows a body runs (a Gated DeltaNet plan's executed tokens, replays included) for which it is
graphed; 0 (the default): never. ``8192`` graphs the bodies of forests of a few thousand unique tokens, where the
host's time per node call exceeds the kernels'."""
MAX_GRAPHS = 4
"""Graphs kept alive at once over the process (a plan's node takes two: forward and backward)."""

_SEEN, _EAGER = "seen", "eager"
_LIVE: OrderedDict = OrderedDict()  # (id of the plan, key) -> (weak plan, key): least recently replayed first


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


def _touch(plan, full_key) -> None:
    """Mark ``plan``'s graph under ``full_key`` as the most recently used; drop the least recent beyond
    :data:`MAX_GRAPHS` (its plan runs that body eagerly from then on)."""
    token = (id(plan), full_key)
    _LIVE[token] = (weakref.ref(plan), full_key)
    _LIVE.move_to_end(token)
    while len(_LIVE) > check_int(MAX_GRAPHS, "harts_hf.kernels.cuda_graphs.MAX_GRAPHS"):
        _, (owner, key) = _LIVE.popitem(last=False)
        owner = owner()
        if owner is not None:
            owner.__dict__["_cuda_graphs"][key] = _EAGER


def _signature(args: tuple) -> tuple:
    return tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a for a in args)


def eligible(tokens: int, tensor: torch.Tensor | None) -> bool:
    """Whether :func:`replay_or_run` may graph a body of ``tokens`` rows on ``tensor``'s device (or runs it, being
    recorded already): a body that may be replayed must not change from call to call in anything but its inputs."""
    limit = check_int(MAX_TOKENS, "harts_hf.kernels.cuda_graphs.MAX_TOKENS (0 turns graphs off)", minimum=0)
    return tensor is not None and tensor.is_cuda and (0 < tokens <= limit or torch.cuda.is_current_stream_capturing())


def replay_or_run(plan, key: tuple, tokens: int, body: Callable, args: tuple) -> tuple:
    """``body(*args)`` (a tuple of tensors or None; ``args`` tensors or None, on one device), through a CUDA graph
    cached on ``plan`` under ``key`` and the arguments' shapes and dtypes when the inputs are on CUDA and ``tokens``
    (the rows the body runs) is at most :data:`MAX_TOKENS`; ``key`` must name everything else the body depends on."""
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if not eligible(tokens, first) or torch.cuda.is_current_stream_capturing():
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
            _log_once(f"harts_hf: a tree node's body could not be recorded as a CUDA graph ({key[0]}: "
                      f"{str(error).splitlines()[0]}); it runs eagerly", logging.WARNING)
            return tuple(body(*args))
    _touch(plan, full_key)
    return entry(args)
