"""OLMo Hybrid: Gated DeltaNet with separate q / k / v / a / b projections and its own output-gate projection
(write strength up to 2 with negative eigenvalues allowed), interleaved with softmax attention (RoPE or NoPE)."""

from __future__ import annotations

import torch

from .core import TreeFamily, register_family
from .gated_deltanet import MixerLayout, gdn_gates, make_tree_gdn_forward


def _project(module, hidden_states):
    x = hidden_states
    U = x.shape[1]
    mixed_qkv = torch.cat([module.q_proj(x), module.k_proj(x), module.v_proj(x)], dim=-1)[0]
    beta, g = gdn_gates(module, module.b_proj(x)[0], module.a_proj(x)[0])
    if module.allow_neg_eigval:
        beta = beta * 2.0
    return mixed_qkv, module.g_proj(x)[0].reshape(U, -1, module.head_v_dim), beta, g


register_family(TreeFamily(
    model_types=("olmo_hybrid",),
    attention_classes=("OlmoHybridAttention",),
    linear_classes={"OlmoHybridGatedDeltaNet": make_tree_gdn_forward(_project, MixerLayout(norm="o_norm",
                                                                                            out_proj="o_proj"))},
))
