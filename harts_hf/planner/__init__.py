"""Planner: cut a batch's prefix forest into pieces within a token budget and place them on microbatches,
data-parallel replicas and gradient-accumulation slots (pure python over plain dataclasses)."""

from .cost import FEATURES, CostModel, nnls
from .plan import Handoff, Microbatch, Piece, Plan, plan

__all__ = ["FEATURES", "CostModel", "Handoff", "Microbatch", "Piece", "Plan", "nnls", "plan"]
