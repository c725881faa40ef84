"""harts_hf: RL training of hybrid-attention language models on rollout trees.

Every token that several trajectories share is computed once, forward and backward, and the
gradient equals training each root-to-leaf trajectory on its own.
"""

__version__ = "0.1.0"
