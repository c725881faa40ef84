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

Memory: every graph of a device records into ONE shared memory pool, so the bodies' temporaries occupy the largest
body's working set once, not once per graph; that is safe because a graph's outputs are copied out right after its
replay, before any other graph runs (nothing reads a graph's buffers later). What stays reserved per graph is its
input and output buffers; at most :data:`MAX_GRAPHS` graphs live at once (the least recently replayed one is dropped
and its call runs eagerly from then on).

Off by default (:data:`MAX_TOKENS` = 0): measured on the H200 the graphs took ``tau`` at scale 0.02 from 0.48 to
0.44 s per fwd+bwd, but with one memory pool per graph (as first written) a 2B model's pieces on 8 ranks reserved
80 GiB in graph pools, and the shared pool has not been timed there yet. CPU tensors, and calls made while another
capture is under way, always run eagerly.
"""

from __future__ import annotations

import logging
import weakref
from collections import OrderedDict
from collections.abc import Callable

import torch

from ._backend import _log_once

__all__ = ["MAX_GRAPHS", "MAX_TOKENS", "replay_or_run"]

MAX_TOKENS = 0
"""Largest number of rows a body runs (a Gated DeltaNet plan's executed tokens, replays included) for which it is
graphed; 0 (the default): never. ``8192`` graphs the bodies of forests of a few thousand unique tokens, where the
host's time per node call exceeds the kernels'."""
MAX_GRAPHS = 8
"""Graphs kept alive at once over the process (a plan's node takes two: forward and backward)."""

_SEEN, _EAGER = "seen", "eager"
_POOLS: dict = {}  # device index -> the graph memory pool every capture on that device shares
_LIVE: OrderedDict = OrderedDict()  # (id of the plan's graph cache, key) -> (weak plan, key): least recent first


class _Graph:
    """``body`` recorded on copies of ``args`` (tensors or None); calling it copies new inputs in, replays and returns
    copies of the outputs (a tuple of tensors or None)."""

    def __init__(self, body: Callable, args: tuple):
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        self.inputs = tuple(torch.empty_like(a, memory_format=torch.contiguous_format).copy_(a)
                            if isinstance(a, torch.Tensor) else a for a in args)
        if device.index not in _POOLS:
            _POOLS[device.index] = torch.cuda.graph_pool_handle()
        self.graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            self.graph.capture_begin(_POOLS[device.index], capture_error_mode="thread_local")
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
    while len(_LIVE) > max(MAX_GRAPHS, 0):
        _, (owner, key) = _LIVE.popitem(last=False)
        owner = owner()
        if owner is not None:
            owner.__dict__["_cuda_graphs"][key] = _EAGER


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
            _log_once(f"harts_hf: a tree node's body could not be recorded as a CUDA graph ({key[0]}: "
                      f"{str(error).splitlines()[0]}); it runs eagerly", logging.WARNING)
            return tuple(body(*args))
    _touch(plan, full_key)
    return entry(args)
