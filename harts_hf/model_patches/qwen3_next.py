"""Qwen3-Next: Gated DeltaNet (fused qkvz / ba projections) + gated softmax attention, optionally MoE."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .core import TreeFamily, autocast_copies, plain_linear, register_family
from .gated_deltanet import gdn_gates, make_tree_gdn_forward


def _project(module, hidden_states):
    """Qwen3-Next packs q, k, v, z per key-head group in one projection and b, a in another."""
    U = hidden_states.shape[1]
    if plain_linear(module.in_proj_qkvz) and plain_linear(module.in_proj_ba):
        # the projections' weight rows taken in [q | k | v | z] and [b | a] order: mixed_qkv and z come out of their
        # GEMMs contiguous, with none of the activation copies (and their backward) of transformers' reordering
        qkv_rows, z_rows, b_rows, a_rows = _row_order(module.num_k_heads, module.num_v_heads, module.head_k_dim,
                                                      module.head_v_dim, hidden_states.device)
        x_qkv, x_z, x_b, x_a = autocast_copies(hidden_states[0], 4)  # SHARED_CASTS: one autocast cast for four GEMMs
        weight, ba_weight = module.in_proj_qkvz.weight, module.in_proj_ba.weight
        mixed_qkv = F.linear(x_qkv, weight.index_select(0, qkv_rows))
        z = F.linear(x_z, weight.index_select(0, z_rows)).reshape(U, -1, module.head_v_dim)
        b, a = F.linear(x_b, ba_weight.index_select(0, b_rows)), F.linear(x_a, ba_weight.index_select(0, a_rows))
        return mixed_qkv, z, *gdn_gates(module, b, a)
    qkvz = module.in_proj_qkvz(hidden_states)
    ba = module.in_proj_ba(hidden_states)
    query, key, value, z, b, a = module.fix_query_key_value_ordering(qkvz, ba)
    mixed_qkv = torch.cat([x[0].reshape(U, -1) for x in (query, key, value)], dim=-1)
    return mixed_qkv, z[0], *gdn_gates(module, b[0], a[0])


@functools.lru_cache(maxsize=64)
def _row_order(num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
               device: torch.device) -> tuple[torch.Tensor, ...]:
    """The rows of ``in_proj_qkvz`` in q, k, v, z order (all heads each) and of ``in_proj_ba`` in b, a order, as
    transformers' ``fix_query_key_value_ordering`` splits them per key-head group."""
    per_group_v = num_v_heads // num_k_heads * head_v_dim
    qkvz = torch.arange(num_k_heads * (2 * head_k_dim + 2 * per_group_v)).view(num_k_heads, -1)
    q, k, v, z = qkvz.split([head_k_dim, head_k_dim, per_group_v, per_group_v], dim=1)
    b, a = torch.arange(2 * num_v_heads).view(num_k_heads, -1).split(num_v_heads // num_k_heads, dim=1)
    qkv = torch.cat([q.reshape(-1), k.reshape(-1), v.reshape(-1)])
    return tuple(rows.reshape(-1).to(device) for rows in (qkv, z, b, a))


register_family(TreeFamily(
    model_types=("qwen3_next",),
    attention_classes=("Qwen3NextAttention",),
    linear_classes={"Qwen3NextGatedDeltaNet": make_tree_gdn_forward(_project)},
    moe=True,
))
