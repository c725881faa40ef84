"""Qwen3.5 (dense and MoE; text models and the language model inside the vision-language model)."""

from __future__ import annotations

from .core import TreeFamily, register_family
from .gated_deltanet import gdn_gates, make_tree_gdn_forward


def _project(module, hidden_states):
    """Qwen3.5 has separate qkv, z, b and a projections."""
    x = hidden_states[0]
    z = module.in_proj_z(x).reshape(x.shape[0], -1, module.head_v_dim)
    return module.in_proj_qkv(x), z, *gdn_gates(module, module.in_proj_b(x), module.in_proj_a(x))


_forward = make_tree_gdn_forward(_project)
register_family(TreeFamily(
    model_types=("qwen3_5", "qwen3_5_text"),
    attention_classes=("Qwen3_5Attention",),
    linear_classes={"Qwen3_5GatedDeltaNet": _forward},
))
register_family(TreeFamily(
    model_types=("qwen3_5_moe", "qwen3_5_moe_text"),
    attention_classes=("Qwen3_5MoeAttention",),
    linear_classes={"Qwen3_5MoeGatedDeltaNet": _forward},
    moe=True,
))
