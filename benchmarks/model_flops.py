"""Model FLOPs of a training pass and the MFU every benchmark row states.

A fwd+bwd pass over work of ``tokens`` token positions and ``pairs`` attended (query, key) pairs costs

    F = 6 * P * tokens + 6 * H * (D_qk + D_v) * L_att * pairs

with ``P`` the matmul parameters one token goes through (every ``nn.Linear`` of the decoder and the LM head; routed
experts at ``top_k / num_experts`` of their weights; embeddings are lookups and count 0), ``H`` query heads of
dimensions ``D_qk`` (queries and keys) and ``D_v`` (values; both ``head_dim`` but in multi-head latent attention) in
each of the ``L_att`` softmax-attention layers (QK^T and PV: 2 H (D_qk + D_v) per pair forward, twice that backward).
The gated-delta-rule recurrences (about 4 dk dv per token and value head) and every elementwise op are left out, so
MFU is a slight under-count of the useful work. The tree's work is its unique tokens and tree pairs
(``PackedForest.stats()``: ``unique_tokens``, ``tree_attention_pairs``), a per-trajectory path's the path tokens
and sum L (L + 1) / 2; their ratio is the FLOP (sharing) ratio.

``MFU = F / (seconds * 989e12)`` (one H200's dense bf16 peak). ``HFU`` adds the recomputed forward of activation
checkpointing (``2 P_ckpt tokens + 2 H (D_qk + D_v) L_ckpt pairs``: the matmul parameters and attention layers of the
checkpointed decoder layers; layers left out by ``tree_stored_layers`` are not, nor are the pairs when
``tree_keep_attention_outputs`` keeps the attention outputs). The LM head's recompute is not counted: past its first
chunk of rows (``head_chunk_size``, 4,096) every chunk is checkpointed and runs its forward again in the backward, on
both paths, so HFU leaves out ``2 P_head`` per row (4.1% of HFU at the 2.3B Qwen3-Next preset, 7.3% at the
Nemotron-H-shaped one; every HFU on BENCHMARKS.md is counted this way).
"""

from __future__ import annotations

import torch

__all__ = ["PEAK_BF16_FLOPS", "flop_rates", "forest_throughput", "throughput"]

PEAK_BF16_FLOPS = 989e12  # one H200, dense bf16 tensor-core peak


def _active_fraction(module, config) -> float:
    """Routed experts run top_k of num_experts per token; everything else runs for every token."""
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    name = type(module).__name__
    if experts and top_k and ("Experts" in name or name.endswith("Expert")):
        return top_k / experts
    return 1.0


def flop_rates(model, checkpointed: list[int] | None = None, attention_recomputed: bool = True) -> dict:
    """FLOPs per token and per attended pair of one fwd+bwd pass of ``model`` (see the module docstring), and of the
    forward recomputed under gradient checkpointing by the decoder layers ``checkpointed`` (indices; None: the
    layers checkpointed now); ``attention_recomputed=False``: the attention outputs are kept
    (``tree_keep_attention_outputs``), no pair is recomputed."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    head = model.get_output_embeddings()
    decoder_layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if checkpointed is None:
        checkpointed = [i for i, layer in enumerate(decoder_layers) if layer.gradient_checkpointing]
    in_layer = {id(p): i for i, layer in enumerate(decoder_layers) for p in layer.parameters()}
    layers_params = head_params = recomputed_params = 0.0
    for module in model.modules():
        fraction = _active_fraction(module, config)
        for parameter in module.parameters(recurse=False):
            if parameter.dim() < 2 or isinstance(module, torch.nn.Embedding):
                continue
            if module is head:
                head_params += parameter.numel()
            else:
                layers_params += parameter.numel() * fraction
                recomputed_params += parameter.numel() * fraction * (in_layer.get(id(parameter)) in checkpointed)
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    attention_layers = sum(1 for kind in layer_types if kind == "full_attention")
    recomputed_attention = sum(1 for i in checkpointed if i < len(layer_types) and layer_types[i] == "full_attention")
    heads, head_dim = config.num_attention_heads, getattr(config, "head_dim", None) or (
        config.hidden_size // config.num_attention_heads)
    if getattr(config, "qk_nope_head_dim", None) is not None:  # latent attention: q/k heads of nope + rope dims
        qk_dim, v_dim = config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim
    else:
        qk_dim = v_dim = head_dim
    pair = 2 * heads * (qk_dim + v_dim)  # forward FLOPs per attended pair in one attention layer (QK^T and PV)
    return dict(matmul_parameters=layers_params + head_params, layer_parameters=layers_params,
                attention_layers=attention_layers, per_token=6 * (layers_params + head_params),
                per_pair=3 * pair * attention_layers, recompute_per_token=2 * recomputed_params,
                recompute_per_pair=pair * recomputed_attention * attention_recomputed, checkpointed_layers=list(checkpointed))


def throughput(rates: dict, seconds: float, tokens: float, pairs: float, path_tokens: float | None = None,
               path_pairs: float | None = None, recompute: bool = True) -> dict:
    """MFU, HFU and tokens/s of a pass over ``tokens`` / ``pairs`` of work taking ``seconds``; with the per-trajectory
    work (``path_tokens`` / ``path_pairs``; default: the same, no sharing) also the FLOP ratio and path tokens/s."""
    path_tokens = tokens if path_tokens is None else path_tokens
    path_pairs = pairs if path_pairs is None else path_pairs
    model_flops = rates["per_token"] * tokens + rates["per_pair"] * pairs
    path_flops = rates["per_token"] * path_tokens + rates["per_pair"] * path_pairs
    hardware_flops = model_flops + recompute * (rates["recompute_per_token"] * tokens + rates["recompute_per_pair"] * pairs)
    peak = seconds * PEAK_BF16_FLOPS
    return dict(model_flops=model_flops, path_flops=path_flops, flop_ratio=path_flops / model_flops,
                mfu=model_flops / peak if peak > 0 else None, hfu=hardware_flops / peak if peak > 0 else None,
                unique_tokens_per_s=tokens / seconds if seconds > 0 else None,
                path_tokens_per_s=path_tokens / seconds if seconds > 0 else None)


def forest_throughput(model, seconds: float, forest_stats: dict, tree: bool,
                      checkpointed: list[int] | None = None, attention_recomputed: bool = True) -> dict:
    """:func:`throughput` of a pass over a forest (``PackedForest.stats()``) taking ``seconds``: the tree's unique
    work (``tree=True``) or the per-trajectory paths' work, the recompute of the ``checkpointed`` decoder layers
    counted in HFU (None: the layers checkpointed now; their attention pairs unless ``attention_recomputed`` is
    False)."""
    unique = (forest_stats["unique_tokens"], forest_stats["tree_attention_pairs"])
    path = (forest_stats["path_tokens"], forest_stats["path_attention_pairs"])
    return throughput(flop_rates(model, checkpointed, attention_recomputed), seconds,
                      *(unique + path if tree else path))

