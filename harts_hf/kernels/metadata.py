"""TreeMetadata: one packed forest on one device plus the tables every tree kernel derives from it.

It travels through a model as a keyword argument, so gradient checkpointing recomputes a layer with the
very same plan; derived tables (ancestor windows, gated-delta-rule plans, attention masks) are built once
per forward and shared by all layers. A planner piece cut out below a branch point carries the hand-off
from its source (``context``) and collects the hand-offs of its own cut-off children (``exports``).
"""

from __future__ import annotations

import torch

from .._checks import check_int
from ..trees import CHUNK_SIZE, PackedForest
from ._backend import resolve_backend
from .context import TreeContext, TreeExport
from .tree_attention import tree_attention_mask
from .tree_conv1d import conv_window_fixups
from .tree_gated_delta_rule import GatedDeltaPlan, build_gated_delta_plan

__all__ = ["TreeMetadata"]


class TreeMetadata:
    """Tree layout for kernels: ``packed`` (on ``device``) and cached derived tables.

    Args:
        packed: the packed forest (moved to ``device``).
        device: where the model runs.
        gdn_backend / attention_backend: ``"auto"``, ``"torch"``/``"sdpa"`` or a fast path (see the kernels).
        chunk_size: chunk length of the linear-attention kernels (64 for fla and transformers).
        context: the hand-off of a piece whose (single) root sits at depth ``d0 = context.ancestor_tokens``.
        exports: one :class:`TreeExport` per cut-off child (its branch token in this packing), filled by the
            forward.
    """

    def __init__(self, packed: PackedForest, device=None, *, gdn_backend: str = "auto",
                 attention_backend: str = "auto", chunk_size: int = CHUNK_SIZE, context: TreeContext | None = None,
                 exports=()):
        device = torch.device(device) if device is not None else packed.device
        self.packed = packed if packed.device == device else packed.to(device)
        # host-side tables (plans, layouts, statistics) are built from the CPU packing: no device round trips
        self._host = packed if packed.device.type == "cpu" else None
        self.device = device
        self.gdn_backend = gdn_backend
        self.attention_backend = attention_backend
        self.chunk_size = check_int(chunk_size, "TreeMetadata: chunk_size")
        self.context = context
        self.exports: list[TreeExport] = list(exports)
        self._cache: dict = {}
        self._check_handoff()

    @property
    def num_tokens(self) -> int:
        return self.packed.num_tokens

    def host_packed(self) -> PackedForest:
        """The packing on the CPU (the one given, or one copy of the device packing)."""
        if self._host is None:
            self._host = self.packed.to("cpu")
        return self._host

    @property
    def context_tokens(self) -> int:
        """``d0``: ancestors of the root outside this forest (0 without a hand-off)."""
        return 0 if self.context is None else self.context.ancestor_tokens

    def _check_handoff(self) -> None:
        host = self.host_packed()
        roots = torch.nonzero(host.parent < 0).squeeze(1)
        root_depth = int(host.position_ids[roots].max())
        if self.context is None and root_depth > 0:
            raise ValueError(f"the packed forest has a root at depth {root_depth} (a piece cut out below a branch "
                             "point); pass context=export.as_context() from the TreeExport of its source piece")
        if self.context is not None and bool((host.position_ids[roots] != self.context.ancestor_tokens).any()):
            raise ValueError(f"context.ancestor_tokens={self.context.ancestor_tokens} needs a forest whose roots all "
                             f"sit at that depth (siblings below one branch token); got {roots.numel()} roots at "
                             f"depths {sorted(set(host.position_ids[roots].tolist()))}")
        for export in self.exports:
            if not 0 <= export.branch_token < host.num_tokens or \
                    export.ancestor_tokens != int(host.position_ids[export.branch_token]) + 1:
                raise ValueError(f"TreeExport(branch_token={export.branch_token}, ancestor_tokens="
                                 f"{export.ancestor_tokens}): the branch token must be a packed index of this forest "
                                 "and ancestor_tokens its depth + 1")

    def ancestors(self, width: int) -> torch.Tensor:
        """``[U, width]`` ancestor table (see ``PackedForest.ancestor_table``); with a hand-off, the root's last
        ``min(width - 1, d0)`` ancestors are rows ``U ..`` (the conv context)."""
        return self.packed.ancestor_table(width, min(width - 1, self.context_tokens))

    def conv_fixups(self, width: int) -> torch.Tensor:
        """:func:`conv_window_fixups` of :meth:`ancestors` (``width``), cached: the rows the tree conv recomputes
        from the ancestor table (found once per forest, not once per layer: it syncs with the device)."""
        key = ("conv_fixups", width)
        if key not in self._cache:
            self._cache[key] = conv_window_fixups(self.ancestors(width), width)
        return self._cache[key]

    def export_index(self, branch_token: int, count: int, context_rows: int) -> torch.Tensor:
        """``[count]`` long: the last ``count`` tokens of the path ending at ``branch_token``, oldest first, as rows
        of ``[this forest's U rows; context_rows rows of the root's nearest ancestors, oldest first]``."""
        key = ("export_index", branch_token, count, context_rows)
        if key not in self._cache:
            parent = self.host_packed().parent.numpy()
            own, token = [], branch_token
            while token >= 0 and len(own) < count:
                own.append(token)
                token = int(parent[token])
            missing = count - len(own)
            if missing > context_rows:
                raise ValueError(f"a hand-off needs {missing} rows above the root but the context holds {context_rows}")
            first = self.num_tokens + context_rows - missing
            index = list(range(first, first + missing)) + own[::-1]
            self._cache[key] = torch.tensor(index, dtype=torch.long, device=self.device)
        return self._cache[key]

    def gdn_backend_for(self, tensor: torch.Tensor) -> str:
        return resolve_backend(self.gdn_backend, tensor, "tree_gated_delta_rule")

    def gdn_plan(self, backend: str, chunk_size: int | None = None) -> GatedDeltaPlan:
        """The gated-delta-rule plan for ``backend`` (fla needs runs cut where children restart), on the chunk grid
        of ``chunk_size`` (default: this metadata's; a Mamba-2 mixer passes its own)."""
        chunk_size = self.chunk_size if chunk_size is None else chunk_size
        key = ("gdn_plan", backend == "fla", chunk_size)
        if key not in self._cache:
            plan = build_gated_delta_plan(self.host_packed(), chunk_size=chunk_size,
                                          final_states_only=backend == "fla",
                                          state_requests=[export.branch_token for export in self.exports])
            self._cache[key] = plan.to(self.device)
        return self._cache[key]

    def varlen_layout(self):
        """Runs and their gathered ancestor paths (the varlen and runs attention paths)."""
        if "varlen_layout" not in self._cache:
            from .tree_attention import build_varlen_layout

            self._cache["varlen_layout"] = build_varlen_layout(self.host_packed(), self.context_tokens).to(self.device)
        return self._cache["varlen_layout"]

    def attention_mask(self, window: int | None = None) -> torch.Tensor:
        """Dense ``[U, U + d0]`` ancestor-or-self mask (the sdpa path; context keys last), within ``window``
        positions of the query where given (sliding-window layers)."""
        key = ("attention_mask", window)
        if key not in self._cache:
            self._cache[key] = tree_attention_mask(self.packed.subtree_end, self.context_tokens, window=window,
                                                   depth=None if window is None else self.packed.position_ids)
        return self._cache[key]

    def stats(self) -> dict:
        """Forest statistics plus the plan's rounds and replay tokens (for the backend in use on this device)."""
        if "stats" not in self._cache:
            stats = self.host_packed().stats(self.chunk_size)
            plan = self.gdn_plan(self.gdn_backend_for(self.packed.input_ids))
            stats.update({f"gdn_{k}": v for k, v in plan.stats.items()})
            self._cache["stats"] = stats
        return dict(self._cache["stats"])
