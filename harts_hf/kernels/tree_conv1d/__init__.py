"""Depthwise causal conv1d over a prefix forest (the packed rows as one sequence: shifted multiply-adds, or fla's fused
conv on CUDA; ancestor windows where runs start), with a per-path reference."""

from .naive import causal_conv1d_reference, tree_causal_conv1d_reference
from .ops import conv_window_fixups, tree_causal_conv1d

__all__ = ["causal_conv1d_reference", "conv_window_fixups", "tree_causal_conv1d", "tree_causal_conv1d_reference"]
