"""TRL trainers on prefix trees: TreeGRPOConfig, TreeGRPOTrainer."""

from .config import TreeGRPOConfig
from .grpo import TreeGRPOTrainer

__all__ = ["TreeGRPOConfig", "TreeGRPOTrainer"]
