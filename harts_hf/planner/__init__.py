"""Planner: cut a batch's prefix forest into pieces within a token budget and place them on microbatches,
data-parallel replicas and gradient-accumulation slots (pure python over plain dataclasses); ``assign_groups``
places whole prompt groups on replicas with equal row counts; ``execute_plan``
runs a plan's pieces on a model (imported on first use: it needs transformers)."""

from .cost import FEATURES, CostModel, nnls
from .plan import Handoff, Microbatch, Piece, Plan, plan
from .replicas import assign_groups, group_cost, imbalance

__all__ = ["FEATURES", "CostModel", "Handoff", "Microbatch", "PieceLogprobs", "Piece", "Plan", "PlanExecution",
           "assign_groups", "engine_backward", "execute_plan", "group_cost", "imbalance", "nnls", "plan"]


def __getattr__(name):
    if name in ("PieceLogprobs", "PlanExecution", "engine_backward", "execute_plan"):
        from . import execute

        return getattr(execute, name)
    raise AttributeError(f"module 'harts_hf.planner' has no attribute {name!r}")
