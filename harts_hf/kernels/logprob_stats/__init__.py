"""Log-prob of the chosen token and entropy per row of LM-head logits: a fused Triton path on CUDA that reads the
logits once each way in their own dtype (never an fp32 ``[rows, vocab]`` copy), with the PyTorch formula as its
reference."""

from .naive import logprob_entropy_reference
from .ops import logprob_entropy, logprob_stats_backend

__all__ = ["logprob_entropy", "logprob_entropy_reference", "logprob_stats_backend"]
