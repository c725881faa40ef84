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

__all__ = ["GDN_REPLAY_NAMES", "TreeContext", "TreeExport"]

GDN_REPLAY_NAMES = ("q", "k", "v", "g", "beta")


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
        backward would produce the same values again)."""
        self.tensors.setdefault(key, tensor)

    def as_context(self, requires_grad: bool = True) -> TreeContext:
        """The child's :class:`TreeContext`: every tensor detached, as a leaf that collects its gradient."""
        return TreeContext(self.ancestor_tokens, {key: tensor.detach().requires_grad_(requires_grad)
                                                  for key, tensor in self.tensors.items()})
