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
import torch.nn.functional as F

from ..kernels.token_ops import kda_gate, token_ops_backend
from .core import TreeFamily, plain_linear, register_family, zero3_enabled
from .gated_deltanet import MixerLayout, make_tree_gdn_forward

KIMI_DELTA_ATTENTION = MixerLayout(key_dim="qkv_dim", value_dim="qkv_dim", head_k_dim="head_dim",
                                   head_v_dim="head_dim", norm="o_norm", out_proj="o_proj")


def _qkv_and_gates(module, x):
    """q, k, v from their own projections (one conv over the three), the forget gate's per-channel log decay
    ``[U, H, K]`` and the write strength ``sigmoid(b)``."""
    return _qkv(module, x), torch.sigmoid(module.b_proj(x))[0], _forget_gate(module.forget_gate, x)


FUSED_INPUTS = True
"""On CUDA: q, k and v as ONE product with the three weights stacked (where each projection is a
:func:`~.core.plain_linear`: no adapter, hook or ZeRO-3 partitioning), not three products and a concatenation of
their outputs, and the forget gate through its projections and fla's fused gate kernel instead of transformers'
module (:func:`_forget_gate`). False: transformers' modules, as before 2026-12-06's evening (the benchmarks'
``fused_module_kda_inputs`` kernel set)."""


def _qkv(module, x):
    """``[U, 3 * H * K]``: the q, k and v projections of ``x [1, U, hidden]`` side by side, as the conv reads them."""
    projections = (module.q_proj, module.k_proj, module.v_proj)
    if FUSED_INPUTS and token_ops_backend(x) != "torch" and all(map(plain_linear, projections)):
        return F.linear(x, torch.cat([p.weight for p in projections]))[0]
    return torch.cat([p(x) for p in projections], dim=-1)[0]


_FORGET_GATES = ("KimiLinearForgetGate", "BailingHybridForgetGate")


def _forget_gate(gate, x):
    """The forget gate's log decay ``[U, H, K]`` for ``x [1, U, hidden]``: transformers' module, or on CUDA its
    projections (called as modules: adapters apply) and fla's fused gate kernel (:func:`~harts_hf.kernels.token_ops
    .kda_gate`), for the two gate classes whose formula it computes, when nothing else sees the module's call (no
    hooks on it) and its parameters can be read outside its forward (no ZeRO-3 partitioning)."""
    if (not FUSED_INPUTS or type(gate).__name__ not in _FORGET_GATES or token_ops_backend(x) == "torch"
            or gate._forward_hooks
            or gate._forward_pre_hooks or zero3_enabled()):
        return gate(x)[0]
    if hasattr(gate, "f_proj"):  # Ling 3: one projection, the safe gate optional, the result in the input's dtype
        f, lower_bound, out_dtype = gate.f_proj(x)[0], gate.lower_bound if gate.safe_gate else None, x.dtype
    else:  # Kimi Linear: a low-rank projection, softplus, fp32
        f, lower_bound, out_dtype = gate.f_b_proj(gate.f_a_proj(x))[0], None, torch.float32
    return kda_gate(f.view(f.shape[0], gate.num_heads, gate.head_dim), gate.A_log, gate.dt_bias,
                    lower_bound=lower_bound, out_dtype=out_dtype)


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
