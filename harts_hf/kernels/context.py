"""Hand-off tensors between planner pieces: what a cut-off piece receives (TreeContext) and what its source
piece produces for it during its own forward (TreeExport).

Tensors are keyed by ``(layer_idx, name)``; ``("hidden",)`` is the final hidden row of the branch token.
Softmax attention: ``"key"``, ``"value"`` ``[d0, HKV, D]`` (after norm and RoPE). Gated DeltaNet: ``"conv"``
``[min(W - 1, d0), conv_dim]`` pre-conv inputs; ``"state"`` ``[HV, K, V]`` fp32 at ``c = C * (d0 // C)`` (absent
when ``c = 0``); ``"q"``, ``"k"``, ``"v"``, ``"g"``, ``"beta"`` post-conv rows of depths ``c .. d0 - 1``. Rows are
ancestors of the piece root, oldest first; ``d0`` = ``ancestor_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["GDN_REPLAY_NAMES", "TreeContext", "TreeExport", "compact"]

GDN_REPLAY_NAMES = ("q", "k", "v", "g", "beta")


def compact(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """``tensor``, or a copy of it when it is a view into a larger storage. Hand-off tensors and their gradients
    outlive the forward that made them (a child's context gradients are kept until its source's backward): a row
    of the final hidden states, or the context part of ``cat([own, context])``'s gradient that autograd hands to a
    leaf, would otherwise keep the whole piece's tensor alive (measured on the GPU: ~3 GiB per child piece)."""
    if tensor is None or tensor.untyped_storage().nbytes() <= tensor.numel() * tensor.element_size():
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


@dataclass
class TreeContext:
    """The ``ancestor_tokens`` (``d0``) ancestors of a piece's root, as hand-off tensors (see the module doc)."""

    ancestor_tokens: int
    tensors: dict = field(default_factory=dict)

    def get(self, layer, name: str) -> torch.Tensor:
        key = (layer, name)
        if key not in self.tensors:
            raise ValueError(f"the hand-off context has no {name!r} rows for layer {layer}; build it from the source "
                             "piece's TreeExport (export.as_context()) after a forward of the same model")
        return self.tensors[key]

    def get_optional(self, layer, name: str) -> torch.Tensor | None:
        return self.tensors.get((layer, name))

    def hidden(self) -> torch.Tensor:
        if ("hidden",) not in self.tensors:
            raise ValueError("the hand-off context has no final hidden row of the branch token ('hidden',); build "
                             "it from the source piece's TreeExport")
        return self.tensors[("hidden",)]


@dataclass
class TreeExport:
    """What one cut-off child needs from this forest: everything on the root path down to packed token
    ``branch_token`` (``ancestor_tokens = depth[branch_token] + 1``). ``tensors`` fills up during a forward."""

    branch_token: int
    ancestor_tokens: int
    tensors: dict = field(default_factory=dict)

    def record(self, key: tuple, tensor: torch.Tensor) -> None:
        """Keep the first tensor recorded under ``key`` in this forward (a checkpointed layer's recompute in the
        backward would produce the same values again). Without gradient (a source's hand-off pass) a view is
        copied, so the export does not keep the forward's whole tensor alive while the children run."""
        if key not in self.tensors:
            self.tensors[key] = tensor if tensor.requires_grad else compact(tensor)

    def as_context(self, requires_grad: bool = True) -> TreeContext:
        """The child's :class:`TreeContext`: every tensor detached, as a leaf that collects its gradient."""
        return TreeContext(self.ancestor_tokens, {key: compact(tensor.detach()).requires_grad_(requires_grad)
                                                  for key, tensor in self.tensors.items()})
