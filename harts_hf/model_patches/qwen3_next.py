"""Qwen3-Next: Gated DeltaNet (fused qkvz / ba projections) + gated softmax attention, optionally MoE."""

from __future__ import annotations

import torch

from .core import TreeFamily, register_family
from .gated_deltanet import gdn_gates, make_tree_gdn_forward


def _project(module, hidden_states):
    """Qwen3-Next packs q, k, v, z per key-head group in one projection and b, a in another."""
    qkvz = module.in_proj_qkvz(hidden_states)
    ba = module.in_proj_ba(hidden_states)
    query, key, value, z, b, a = module.fix_query_key_value_ordering(qkvz, ba)
    U = hidden_states.shape[1]
    mixed_qkv = torch.cat([x[0].reshape(U, -1) for x in (query, key, value)], dim=-1)
    return mixed_qkv, z[0], *gdn_gates(module, b[0], a[0])


register_family(TreeFamily(
    model_types=("qwen3_next",),
    attention_classes=("Qwen3NextAttention",),
    linear_classes={"Qwen3NextGatedDeltaNet": make_tree_gdn_forward(_project)},
    moe=True,
))
