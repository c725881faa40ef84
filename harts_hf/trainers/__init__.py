"""TRL trainers on prefix trees: TreeGRPOConfig / TreeGRPOTrainer, TreeSFTConfig / TreeSFTTrainer."""

from .config import TreeGRPOConfig
from .grpo import TreeGRPOTrainer
from .sft import TreeSFTConfig, TreeSFTTrainer

__all__ = ["TreeGRPOConfig", "TreeGRPOTrainer", "TreeSFTConfig", "TreeSFTTrainer"]
