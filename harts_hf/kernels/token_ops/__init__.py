"""Per-token ops of the decoder outside the mixers (RMSNorm, gated RMSNorm, SwiGLU), fused on CUDA through fla's
Triton kernels (or, for RMSNorm, harts_hf's own: ``ops.NORM_KERNEL = "harts"``), with the formulas transformers
computes as their references."""

from .naive import gated_rms_norm_reference, rms_norm_reference, swiglu_reference
from .ops import gated_rms_norm, rms_norm, swiglu, token_ops_backend

__all__ = ["gated_rms_norm", "gated_rms_norm_reference", "rms_norm", "rms_norm_reference", "swiglu",
           "swiglu_reference", "token_ops_backend"]
