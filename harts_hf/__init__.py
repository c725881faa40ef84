"""harts_hf: RL training of hybrid-attention language models on rollout trees.

Every token that several trajectories share is computed once, forward and backward, and the
gradient equals training each root-to-leaf trajectory on its own.
"""

__version__ = "0.1.0"

__all__ = ["TreeGRPOConfig", "TreeGRPOTrainer", "TreeSFTConfig", "TreeSFTTrainer", "tree_logprobs"]


def __getattr__(name):
    # heavy imports (transformers, trl) only when asked for
    if name == "tree_logprobs":
        from .logprobs import tree_logprobs

        return tree_logprobs
    if name in ("TreeGRPOConfig", "TreeGRPOTrainer", "TreeSFTConfig", "TreeSFTTrainer"):
        from . import trainers

        return getattr(trainers, name)
    raise AttributeError(f"module 'harts_hf' has no attribute {name!r}")
