"""Kimi Delta Attention hybrids: a gated delta rule with one decay per key channel, interleaved with multi-head latent
attention and routed experts with a shared one.

- Kimi Linear (``kimi_linear``): latent attention without positional encoding; a low-rank output gate.
- Ling 3 (``bailing_hybrid``, the HARTS paper's family): the forget gate's bounded "safe gate"
  (``lower_bound * sigmoid(exp(A_log) * (f + dt_bias))``), a full-rank output gate, latent attention with RoPE on
  its decoupled key part and a head-wise sigmoid gate; its multi-token-prediction layers are not part of the
  decoder's forward (training scores the decoder's next-token predictions only).
"""

from __future__ import annotations

import torch

from .core import TreeFamily, register_family
from .gated_deltanet import MixerLayout, make_tree_gdn_forward

KIMI_DELTA_ATTENTION = MixerLayout(key_dim="qkv_dim", value_dim="qkv_dim", head_k_dim="head_dim",
                                   head_v_dim="head_dim", norm="o_norm", out_proj="o_proj")


def _qkv_and_gates(module, x):
    """q, k, v from their own projections (one conv over the three), the forget gate's per-channel log decay
    ``[U, H, K]`` and the write strength ``sigmoid(b)``."""
    mixed_qkv = torch.cat([module.q_proj(x), module.k_proj(x), module.v_proj(x)], dim=-1)[0]
    return mixed_qkv, torch.sigmoid(module.b_proj(x))[0], module.forget_gate(x)[0]


def _kimi_project(module, hidden_states):
    mixed_qkv, beta, g = _qkv_and_gates(module, hidden_states)
    gate = module.g_b_proj(module.g_a_proj(hidden_states))[0]
    return mixed_qkv, gate.reshape(gate.shape[0], -1, module.head_dim), beta, g


def _ling_project(module, hidden_states):
    mixed_qkv, beta, g = _qkv_and_gates(module, hidden_states)
    gate = module.g_proj(hidden_states)[0]
    return mixed_qkv, gate.reshape(gate.shape[0], -1, module.head_dim), beta, g


# their routers balance experts with a bias: no load-balancing loss to weight (moe=False)
register_family(TreeFamily(
    model_types=("kimi_linear",),
    attention_classes=("KimiLinearAttention",),
    linear_classes={"KimiLinearDeltaAttention": make_tree_gdn_forward(_kimi_project, KIMI_DELTA_ATTENTION)},
))
register_family(TreeFamily(
    model_types=("bailing_hybrid",),
    attention_classes=("BailingHybridAttention",),
    linear_classes={"BailingHybridDeltaAttention": make_tree_gdn_forward(_ling_project, KIMI_DELTA_ATTENTION)},
))
