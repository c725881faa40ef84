"""Softmax attention over a prefix forest (ancestor-or-self visibility), with a per-path reference."""

from .naive import causal_attention_reference, tree_attention_reference
from .ops import tree_attention, tree_attention_mask
from .varlen import VarlenLayout, build_varlen_layout, tree_attention_varlen

__all__ = [
    "VarlenLayout",
    "build_varlen_layout",
    "tree_attention_varlen","causal_attention_reference", "tree_attention", "tree_attention_mask", "tree_attention_reference"]
