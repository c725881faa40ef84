"""Depthwise causal conv1d over a prefix forest (ancestor-window gather), with a per-path reference."""

from .naive import causal_conv1d_reference, tree_causal_conv1d_reference
from .ops import tree_causal_conv1d

__all__ = ["causal_conv1d_reference", "tree_causal_conv1d", "tree_causal_conv1d_reference"]
