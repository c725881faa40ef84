"""TreeMetadata: one packed forest on one device plus the tables every tree kernel derives from it.

It travels through a model as a keyword argument, so gradient checkpointing recomputes a layer with the
very same plan; derived tables (ancestor windows, gated-delta-rule plans, attention masks) are built once
per forward and shared by all layers.
"""

from __future__ import annotations

import torch

from ..trees import CHUNK_SIZE, PackedForest
from ._backend import resolve_backend
from .tree_attention import tree_attention_mask
from .tree_gated_delta_rule import GatedDeltaPlan, build_gated_delta_plan

__all__ = ["TreeMetadata"]


class TreeMetadata:
    """Tree layout for kernels: ``packed`` (on ``device``) and cached derived tables.

    Args:
        packed: the packed forest (moved to ``device``).
        device: where the model runs.
        gdn_backend / attention_backend: ``"auto"``, ``"torch"``/``"sdpa"`` or a fast path (see the kernels).
        chunk_size: chunk length of the linear-attention kernels (64 for fla and transformers).
    """

    def __init__(self, packed: PackedForest, device=None, *, gdn_backend: str = "auto",
                 attention_backend: str = "auto", chunk_size: int = CHUNK_SIZE):
        device = torch.device(device) if device is not None else packed.device
        self.packed = packed if packed.device == device else packed.to(device)
        # host-side tables (plans, layouts, statistics) are built from the CPU packing: no device round trips
        self._host = packed if packed.device.type == "cpu" else None
        self.device = device
        self.gdn_backend = gdn_backend
        self.attention_backend = attention_backend
        self.chunk_size = chunk_size
        self._cache: dict = {}

    @property
    def num_tokens(self) -> int:
        return self.packed.num_tokens

    def host_packed(self) -> PackedForest:
        """The packing on the CPU (the one given, or one copy of the device packing)."""
        if self._host is None:
            self._host = self.packed.to("cpu")
        return self._host

    def ancestors(self, width: int) -> torch.Tensor:
        """``[U, width]`` ancestor table (see ``PackedForest.ancestor_table``)."""
        return self.packed.ancestor_table(width)

    def gdn_backend_for(self, tensor: torch.Tensor) -> str:
        return resolve_backend(self.gdn_backend, tensor, "tree_gated_delta_rule")

    def gdn_plan(self, backend: str) -> GatedDeltaPlan:
        """The gated-delta-rule plan for ``backend`` (fla needs runs cut where children restart)."""
        key = ("gdn_plan", backend == "fla")
        if key not in self._cache:
            plan = build_gated_delta_plan(self.host_packed(), chunk_size=self.chunk_size,
                                          final_states_only=backend == "fla")
            self._cache[key] = plan.to(self.device)
        return self._cache[key]

    def varlen_layout(self):
        """Runs and their gathered ancestor paths (the varlen and runs attention paths)."""
        if "varlen_layout" not in self._cache:
            from .tree_attention import build_varlen_layout

            self._cache["varlen_layout"] = build_varlen_layout(self.host_packed()).to(self.device)
        return self._cache["varlen_layout"]

    def attention_mask(self) -> torch.Tensor:
        """Dense ``[U, U]`` ancestor-or-self mask (the sdpa path)."""
        if "attention_mask" not in self._cache:
            self._cache["attention_mask"] = tree_attention_mask(self.packed.subtree_end)
        return self._cache["attention_mask"]

    def stats(self) -> dict:
        """Forest statistics plus the plan's rounds and replay tokens (for the backend in use on this device)."""
        if "stats" not in self._cache:
            stats = self.host_packed().stats(self.chunk_size)
            plan = self.gdn_plan(self.gdn_backend_for(self.packed.input_ids))
            stats.update({f"gdn_{k}": v for k, v in plan.stats.items()})
            self._cache["stats"] = stats
        return dict(self._cache["stats"])
