"""Per-token ops of the decoder outside the mixers (RMSNorm, gated RMSNorm, Mamba-2's grouped gated norm, SwiGLU,
squared ReLU, Kimi Delta Attention's forget gate), fused on CUDA: RMSNorm, the grouped gated norm and the squared ReLU
on harts_hf's own Triton kernels (``ops.NORM_KERNEL``: fla's RMSNorm on request), the others on fla's, with the formulas
transformers computes as their references."""

from .naive import (
    gated_rms_norm_reference,
    group_gated_rms_norm_reference,
    kda_gate_reference,
    relu_squared_reference,
    rms_norm_reference,
    swiglu_reference,
)
from .ops import gated_rms_norm, group_gated_rms_norm, kda_gate, relu_squared, rms_norm, swiglu, token_ops_backend

__all__ = ["gated_rms_norm", "gated_rms_norm_reference", "group_gated_rms_norm", "group_gated_rms_norm_reference",
           "kda_gate", "kda_gate_reference", "relu_squared", "relu_squared_reference", "rms_norm", "rms_norm_reference",
           "swiglu", "swiglu_reference", "token_ops_backend"]
