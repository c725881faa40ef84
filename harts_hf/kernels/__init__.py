"""Tree ops, each in its own folder with a per-path reference; no transformers or trl imports here."""

from .context import TreeContext, TreeExport
from .metadata import TreeMetadata
from .tree_attention import (
    build_varlen_layout,
    tree_attention,
    tree_attention_mask,
    tree_attention_reference,
)
from .tree_conv1d import tree_causal_conv1d, tree_causal_conv1d_reference
from .tree_gated_delta_rule import (
    GatedDeltaPlan,
    build_gated_delta_plan,
    tree_gated_delta_rule,
    tree_gated_delta_rule_reference,
)

__all__ = [
    "build_varlen_layout",
    "TreeContext",
    "TreeExport",
    "TreeMetadata",
    "GatedDeltaPlan",
    "build_gated_delta_plan",
    "tree_attention",
    "tree_attention_mask",
    "tree_attention_reference",
    "tree_causal_conv1d",
    "tree_causal_conv1d_reference",
    "tree_gated_delta_rule",
    "tree_gated_delta_rule_reference",
]
