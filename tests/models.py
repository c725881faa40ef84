"""Tiny transformers models built from configs in code (no network): every family harts_hf patches."""

import torch
import transformers

VOCAB = 97
LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
              linear_conv_kernel_dim=4)
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=512, tie_word_embeddings=False)
HYBRID_LAYERS = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
           router_aux_loss_coef=0.01)


def _mild_decay(model):
    """Decays as in trained checkpoints (A in [0.01, 1]) rather than transformers' random init (up to 16): with
    A up to 16 the fp32 *reference's* A_log/dt_bias gradients alone carry ~1e-3 rounding (see test_tree_logprobs)."""
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "A_log"):
                module.A_log.copy_(torch.empty_like(module.A_log).uniform_(0.01, 1.0).log())
    return model


def build(name: str, seed: int = 0, dtype=torch.float32, mild_decay: bool = True):
    """A tiny model of family ``name`` with seeded random weights, in eval mode."""
    torch.manual_seed(seed)
    if name == "qwen3_next":
        config = transformers.Qwen3NextConfig(**COMMON, **LINEAR, layer_types=HYBRID_LAYERS,
                                              mlp_only_layers=list(range(4)), num_hidden_layers=4)
        model = transformers.Qwen3NextForCausalLM(config)
    elif name == "qwen3_next_moe":
        config = transformers.Qwen3NextConfig(**COMMON, **LINEAR, **MOE, layer_types=HYBRID_LAYERS, num_hidden_layers=4)
        model = transformers.Qwen3NextForCausalLM(config)
    elif name == "qwen3_5":
        config = transformers.Qwen3_5TextConfig(**COMMON, **LINEAR, layer_types=HYBRID_LAYERS, num_hidden_layers=4)
        model = transformers.Qwen3_5ForCausalLM(config)
    elif name == "qwen3_5_vl":
        text = dict(COMMON, **LINEAR, layer_types=HYBRID_LAYERS, num_hidden_layers=4)
        vision = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=32)
        model = transformers.Qwen3_5ForConditionalGeneration(transformers.Qwen3_5Config(text_config=text, vision_config=vision))
    elif name == "qwen3_5_moe":
        moe = {k: v for k, v in MOE.items() if k != "router_aux_loss_coef"}
        config = transformers.Qwen3_5MoeTextConfig(**COMMON, **LINEAR, **moe, layer_types=HYBRID_LAYERS, num_hidden_layers=4)
        model = transformers.Qwen3_5MoeForCausalLM(config)
    elif name == "qwen3_moe":
        moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, router_aux_loss_coef=0.01)
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**COMMON, **moe, num_hidden_layers=2))
    elif name == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON, num_hidden_layers=2))
    elif name == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**COMMON, num_hidden_layers=2))
    elif name == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**COMMON, num_hidden_layers=2))
    elif name in ("mistral", "mistral_sliding"):
        window = dict(sliding_window=64) if name == "mistral_sliding" else dict(sliding_window=None)
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**COMMON, **window, num_hidden_layers=2))
    elif name == "phi3":
        model = transformers.Phi3ForCausalLM(transformers.Phi3Config(**COMMON, num_hidden_layers=2,
                                                                     pad_token_id=0))
    elif name == "olmo2":
        model = transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**COMMON, num_hidden_layers=2))
    elif name == "gemma3_text":  # mixed sliding (window 64) and full layers, query_pre_attn_scalar, q/k norms
        config = transformers.Gemma3TextConfig(**COMMON, num_hidden_layers=3, sliding_window=64,
                                               layer_types=["sliding_attention", "sliding_attention",
                                                            "full_attention"], query_pre_attn_scalar=24,
                                               final_logit_softcapping=None, attn_logit_softcapping=None)
        model = transformers.Gemma3ForCausalLM(config)
    elif name == "cohere2":  # parallel attention / MLP block, logit_scale on the head, sliding + full layers
        config = transformers.Cohere2Config(**COMMON, num_hidden_layers=2, sliding_window=64, logit_scale=0.5,
                                            layer_types=["sliding_attention", "full_attention"])
        model = transformers.Cohere2ForCausalLM(config)
    elif name == "granite":  # embedding / residual / attention multipliers, logits divided by logits_scaling
        config = transformers.GraniteConfig(**COMMON, num_hidden_layers=2, logits_scaling=4.0, embedding_multiplier=2.0,
                                            residual_multiplier=0.5, attention_multiplier=0.3)
        model = transformers.GraniteForCausalLM(config)
    elif name == "glm4_moe":  # partial rotary (half the head dim), routed + shared experts after a dense layer
        config = transformers.Glm4MoeConfig(**COMMON, num_hidden_layers=2, n_routed_experts=4, num_experts_per_tok=2,
                                            moe_intermediate_size=16, first_k_dense_replace=1, n_group=1,
                                            topk_group=1, partial_rotary_factor=0.5, pad_token_id=0)
        model = transformers.Glm4MoeForCausalLM(config)
    elif name == "gpt2":  # learned absolute positions (wpe), layers at transformer.h, tied head, no dropout
        config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=512,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(config)
    elif name == "opt":  # learned positions with an offset of 2, fc1 / fc2 as bare linears in the layer; without
        # biases: a key bias has gradient zero in exact arithmetic, and AdamW turns its rounding into full-size steps
        # of random sign (test_every_family checks OPT's default config, biases included, on log-probs and gradients)
        config = transformers.OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=48, num_hidden_layers=2,
                                        num_attention_heads=4, max_position_embeddings=512, word_embed_proj_dim=32,
                                        dropout=0.0, pad_token_id=1, enable_bias=False)
        model = transformers.OPTForCausalLM(config)
    elif name == "mixtral":
        config = transformers.MixtralConfig(**COMMON, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2)
        model = transformers.MixtralForCausalLM(config)
    elif name == "gemma2":  # attention logit softcapping (50), final-logit softcapping (30), sliding + full layers
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**COMMON, num_hidden_layers=2))
    elif name == "gpt_oss":  # attention sinks, routed experts, sliding + full layers
        config = transformers.GptOssConfig(**COMMON, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
                                           sliding_window=64, layer_types=["sliding_attention", "full_attention"],
                                           router_aux_loss_coef=0.0)
        model = transformers.GptOssForCausalLM(config)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_()  # transformers initialises them to zero
    elif name in ("deepseek_v3", "deepseek_v2"):  # multi-head latent attention: q/k heads of 16 + 8 (RoPE part),
        # value heads of 12; low-rank q (V3) or a plain q projection (V2); routed experts in groups + a shared one
        common = dict({k: v for k, v in COMMON.items() if k != "head_dim"}, num_key_value_heads=4)
        mla = dict(num_hidden_layers=2, kv_lora_rank=16,
                   qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=16, first_k_dense_replace=1, n_group=2, topk_group=1, n_shared_experts=1)
        if name == "deepseek_v3":
            model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**common, **mla, q_lora_rank=16))
        else:
            model = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**common, **mla, q_lora_rank=None))
    elif name in ("kimi_linear", "kimi_linear_dense"):  # Kimi Delta Attention (per-channel decays) + latent
        # attention without RoPE + experts (dense: MLPs only; transformers' grouped expert matmul has no fp64)
        common = dict({k: v for k, v in COMMON.items() if k != "head_dim"}, num_key_value_heads=4)
        mlps = ["dense", "sparse"] * 2 if name == "kimi_linear" else ["dense"] * 4
        config = transformers.KimiLinearConfig(
            **common, num_hidden_layers=4, layer_types=HYBRID_LAYERS, mlp_layer_types=mlps,
            kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
            linear_head_dim=8, linear_num_heads=4, linear_conv_kernel_dim=4, num_local_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)
        model = transformers.KimiLinearForCausalLM(config)
    elif name in ("bailing_hybrid", "bailing_hybrid_dense"):  # Ling 3: KDA with the safe gate + gated latent
        # attention with RoPE on its decoupled part + grouped experts (dense: MLPs only, for fp64)
        common = dict({k: v for k, v in COMMON.items() if k != "head_dim"}, num_key_value_heads=4)
        mlps = ["dense", "sparse"] * 2 if name == "bailing_hybrid" else ["dense"] * 4
        config = transformers.BailingHybridConfig(
            **common, num_hidden_layers=4, layer_types=HYBRID_LAYERS, mlp_layer_types=mlps, head_dim=8,
            kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
            short_conv_kernel_size=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            n_shared_experts=1, n_group=2, topk_group=1, num_mtp_layers=1, pad_token_id=0, eos_token_id=2)
        model = transformers.BailingHybridForCausalLM(config)
    elif name in ("nemotron_h", "nemotron_h_dense", "bamba", "granitemoehybrid", "falcon_h1", "falcon_h1_no_norm"):  # Mamba-2 hybrids: 4 heads of 8, state 8, 2 groups,
        # chunks of 16 (the forks at 63-65 and 127-129 sit at its chunk edges too)
        mamba = dict(mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8, mamba_n_groups=2, mamba_d_conv=4,
                     mamba_expand=1, mamba_chunk_size=16)
        if name.startswith("nemotron_h"):  # dense: an MLP block for the MoE one (grouped expert matmuls have no fp64)
            blocks = ["mamba", "attention", "mlp" if name.endswith("dense") else "moe", "mamba", "mlp"]
            config = transformers.NemotronHConfig(
                **COMMON, layers_block_type=blocks, mamba_num_heads=4,
                mamba_head_dim=8, ssm_state_size=8, n_groups=2, conv_kernel=4, chunk_size=16, n_routed_experts=4,
                num_experts_per_tok=2, moe_intermediate_size=16, moe_shared_expert_intermediate_size=16)
            model = transformers.NemotronHForCausalLM(config)
        elif name.startswith("falcon_h1"):  # parallel Mamba-2 and attention in every layer, muP multipliers
            config = transformers.FalconH1Config(
                **{k: v for k, v in COMMON.items() if k != "head_dim"}, num_hidden_layers=2, **mamba,
                mamba_d_ssm=32, mamba_rms_norm=name == "falcon_h1", ssm_in_multiplier=0.7, ssm_out_multiplier=1.3,
                attention_in_multiplier=0.9, attention_out_multiplier=1.1, key_multiplier=0.8,
                ssm_multipliers=[0.5, 1.5, 0.8, 1.2, 0.9], mlp_multipliers=[1.2, 0.7], embedding_multiplier=2.0,
                lm_head_multiplier=0.6)
            model = transformers.FalconH1ForCausalLM(config)
        elif name == "bamba":
            config = transformers.BambaConfig(**COMMON, num_hidden_layers=3, attn_layer_indices=[1], **mamba)
            model = transformers.BambaForCausalLM(config)
        else:
            config = transformers.GraniteMoeHybridConfig(
                **{k: v for k, v in COMMON.items() if k != "head_dim"}, num_hidden_layers=3,
                layer_types=["mamba", "attention", "mamba"], num_local_experts=4, num_experts_per_tok=2,
                shared_intermediate_size=24, position_embedding_type="rope", embedding_multiplier=2.0,
                residual_multiplier=0.5, attention_multiplier=0.3, logits_scaling=2.0, **mamba)
            model = transformers.GraniteMoeHybridForCausalLM(config)
    elif name == "olmo_hybrid":  # Gated DeltaNet (separate projections, beta up to 2) + attention with q/k norms
        config = transformers.OlmoHybridConfig(**COMMON, **LINEAR, layer_types=HYBRID_LAYERS, num_hidden_layers=4,
                                               pad_token_id=0, eos_token_id=2)
        model = transformers.OlmoHybridForCausalLM(config)
    else:
        raise ValueError(name)
    if mild_decay:
        _mild_decay(model)
    return model.to(dtype).eval()


FAMILIES = ["qwen3_next", "qwen3_next_moe", "qwen3_5", "qwen3_5_vl", "qwen3_5_moe", "kimi_linear", "bailing_hybrid",
            "olmo_hybrid", "nemotron_h", "bamba", "granitemoehybrid", "falcon_h1", "falcon_h1_no_norm", "llama", "qwen2",
            "qwen3", "qwen3_moe"]
