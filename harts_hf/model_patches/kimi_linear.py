"""Kimi Linear: Kimi Delta Attention (a gated delta rule with one decay per key channel) interleaved with multi-head
latent attention without positional encoding, routed experts with a shared one."""

from __future__ import annotations

import torch

from .core import TreeFamily, register_family
from .gated_deltanet import MixerLayout, make_tree_gdn_forward


def _project(module, hidden_states):
    """q, k, v from their own projections (one conv over the three), the per-channel log decay of the forget gate
    and the write strength ``sigmoid(b)``; the output gate from its low-rank projection."""
    x = hidden_states
    U = x.shape[1]
    mixed_qkv = torch.cat([module.q_proj(x), module.k_proj(x), module.v_proj(x)], dim=-1)[0]
    g = module.forget_gate(x)[0]  # [U, H, K], <= 0, fp32
    beta = torch.sigmoid(module.b_proj(x))[0]
    gate = module.g_b_proj(module.g_a_proj(x))[0].reshape(U, -1, module.head_dim)
    return mixed_qkv, gate, beta, g


KIMI_DELTA_ATTENTION = MixerLayout(key_dim="qkv_dim", value_dim="qkv_dim", head_k_dim="head_dim",
                                   head_v_dim="head_dim", norm="o_norm", out_proj="o_proj")

register_family(TreeFamily(
    model_types=("kimi_linear",),
    attention_classes=("KimiLinearAttention",),
    linear_classes={"KimiLinearDeltaAttention": make_tree_gdn_forward(_project, KIMI_DELTA_ATTENTION)},
    moe=False,  # its router balances experts with a bias: no load-balancing loss to weight
))
