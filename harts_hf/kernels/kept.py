"""A tree node's costliest forward work, kept by selective activation checkpointing instead of rerun in the backward.

Under whole-layer checkpointing the backward reruns each layer's forward, the linear-attention and Mamba-2 nodes'
state passes and output stages included, only so that the layers' later ops get their inputs again. A node's forward
calls :func:`run` with a body (a function of tensors returning a tuple of tensors: the node's output and whatever
else its backward reads from that part) and the body's inputs. Inside an open checkpointed call whose policy keeps
mixer outputs (:func:`harts_hf.model_patches.keep_mixer_outputs`), the body runs as one dispatcher op,
``harts::kept_body``, which the policy keeps: the forward stores its outputs, and the rerun takes them back instead of
running the body again. Anywhere else the body just runs. The arithmetic is the same either way: checkpointing
changes what is kept, never what is computed (the bodies' kernels are deterministic in their forward).

The op's Python body is looked up in a table by a call number (a dispatcher op takes tensors and numbers, not
functions); a call that the rerun answers from the store never runs its body, and its entry is dropped.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable

import torch

__all__ = ["open_calls", "run"]

_local = threading.local()  # this thread's open checkpointed calls (innermost last), pushed by checkpointing
_bodies: dict[int, Callable] = {}
_numbers = itertools.count()


def open_calls() -> list:
    """This thread's open checkpointed calls, innermost last: objects with ``mode`` (selective checkpointing's
    dispatch mode for this pass, to enter around a kept body; None where it is entered over the whole call already)
    and ``mixers`` (whether the policy keeps mixer outputs)."""
    calls = getattr(_local, "calls", None)
    if calls is None:
        calls = _local.calls = []
    return calls


@torch.library.custom_op("harts::kept_body", mutates_args=())
def _kept_body(inputs: list[torch.Tensor | None], call: int) -> list[torch.Tensor]:
    outputs = _bodies.pop(call)(*inputs)
    pointers = {x.untyped_storage().data_ptr() for x in inputs if x is not None}
    # an op's outputs must not alias its inputs (a body returning a view of one, e.g. on the identity layout)
    return [x.clone() if x.untyped_storage().data_ptr() in pointers else x for x in outputs]


def run(body: Callable, inputs: tuple) -> tuple:
    """``body(*inputs)`` (``inputs``: tensors or None; the result: a tuple of tensors), kept from the forward for the
    checkpointed rerun where the innermost open checkpointed call keeps mixer outputs. Call it where autograd does not
    record (inside an ``autograd.Function``'s forward): the op has no derivative of its own."""
    calls = open_calls()
    if not calls or not calls[-1].mixers:
        return tuple(body(*inputs))
    number = next(_numbers)
    _bodies[number] = body
    try:
        with calls[-1].mode or contextlib.nullcontext():  # None: the call's mode is entered already
            return tuple(torch.ops.harts.kept_body(list(inputs), number))
    finally:
        _bodies.pop(number, None)
