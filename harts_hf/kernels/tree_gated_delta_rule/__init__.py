"""Gated delta rule over a prefix forest: plan (runs, chunk-aligned restart, replay, rounds), executors, reference."""

from .chunked import chunk_gated_delta_rule_torch, l2_normalize
from .naive import gated_delta_rule_chunked, gated_delta_rule_recurrent, tree_gated_delta_rule_reference
from .ops import tree_gated_delta_rule
from .plan import CONTEXT_STATE, GatedDeltaPlan, GatedDeltaRound, build_gated_delta_plan

__all__ = [
    "CONTEXT_STATE",
    "GatedDeltaPlan",
    "GatedDeltaRound",
    "build_gated_delta_plan",
    "chunk_gated_delta_rule_torch",
    "gated_delta_rule_chunked",
    "gated_delta_rule_recurrent",
    "l2_normalize",
    "tree_gated_delta_rule",
    "tree_gated_delta_rule_reference",
]
