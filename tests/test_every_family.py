"""Every causal-LM model type the installed transformers ships, built tiny from its own default config: either its
tree log-probs and parameter gradients match transformers' model run one sequence at a time (fp32), or
``apply_tree_patches`` refuses it with a ValueError. Never a crash on the forest, never a silent difference.

The tiny config is the model type's default config with common size fields shrunk (one decoder layer of each
layer type, sliding windows and chunk sizes of 64 so the forks at depths 63-65 and sequences of 300 tokens cross
them). A type whose config this generic shrinking cannot make small and valid is skipped with the reason (its
own family tests, where it has one, build it by hand)."""

import warnings

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from harts_hf import tree_logprobs
from harts_hf.model_patches import apply_tree_patches, supported_model_types
from harts_hf.reference import per_sequence_logprobs
from tests.forests import chunk_edge_sequences
from tests.models import _mild_decay
from tests.test_tree_logprobs import assert_gradients_close

VOCAB = 97
MAX_PARAMETERS = 30_000_000
SIZES = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, moe_intermediate_size=16, num_experts=4, num_local_experts=4, n_routed_experts=4,
             num_experts_per_tok=2, shared_expert_intermediate_size=16, max_position_embeddings=512,
             tie_word_embeddings=False, ffn_hidden_size=48, n_embd=32, n_head=4, d_model=32, kv_lora_rank=8,
             q_lora_rank=8, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, first_k_dense_replace=1,
             n_group=1, topk_group=1, index_topk=16, index_n_heads=2, index_head_dim=16, mamba_n_heads=4,
             mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1, mamba_expand=2, mamba_d_conv=4,
             mamba_chunk_size=64, attention_dropout=0.0, hidden_dropout=0.0, dropout=0.0)
WINDOWS = ("sliding_window", "attention_chunk_size", "chunk_size")
MULTIMODAL = ("vision_config", "audio_config", "encoder_config", "decoder_config", "speech_config")


def tiny_config_kwargs(config) -> dict:
    """Size fields of ``config``'s type shrunk; per-layer lists cut to one layer of each layer type."""
    fields = config.to_dict()
    kwargs = {key: value for key, value in SIZES.items() if key in fields}
    if "kv_lora_rank" in fields or "qk_rope_head_dim" in fields:  # latent attention: q/k head dims come from the parts
        kwargs.pop("head_dim", None)
        kwargs["num_key_value_heads"] = kwargs.get("num_attention_heads", 4)
    layers = fields.get("num_hidden_layers") or fields.get("n_layer") or 2
    kinds = fields.get("layer_types") or fields.get("layers_block_type")
    keep = [0, 1]
    if isinstance(kinds, (list, tuple)) and len(kinds) == layers:
        keep = sorted({kind: index for index, kind in reversed(list(enumerate(kinds)))}.values())
        keep = keep if len(keep) > 1 else [0, 1]
    keep = [index for index in keep if index < layers]
    for key, value in fields.items():
        if isinstance(value, (list, tuple, str)) and len(value) == layers > len(keep) and key != "model_type":
            kwargs[key] = "".join(value[i] for i in keep) if isinstance(value, str) else [value[i] for i in keep]
    for key in ("num_hidden_layers", "n_layer"):
        if key in fields:
            kwargs[key] = len(keep)
    kwargs.update({key: 64 for key in WINDOWS if fields.get(key)})
    if fields.get("rotary_dim"):
        kwargs["rotary_dim"] = 8
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(fields.get(key), int) and fields[key] >= VOCAB:
            kwargs[key] = 0
    return kwargs


def build_tiny(model_type: str):
    """A tiny model of ``model_type`` in eval mode, or ``pytest.skip`` with the reason it cannot be built."""
    try:
        config = AutoConfig.for_model(model_type)
    except Exception as error:
        pytest.skip(f"{model_type}: its default config does not build ({type(error).__name__}: {str(error)[:160]})")
    if any(getattr(config, key, None) is not None for key in MULTIMODAL):
        pytest.skip(f"{model_type}: a multimodal config; its text model type is checked on its own")
    try:
        config = AutoConfig.for_model(model_type, **tiny_config_kwargs(config))
        with torch.device("meta"):
            size = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    except Exception as error:  # the generic shrinking made an invalid config, or an optional dependency is missing
        pytest.skip(f"{model_type}: no tiny config from its defaults ({type(error).__name__}: {str(error)[:160]})")
    if size > MAX_PARAMETERS:
        pytest.skip(f"{model_type}: {size / 1e6:.0f}M parameters after shrinking the common size fields")
    torch.manual_seed(0)
    try:
        model = AutoModelForCausalLM.from_config(config)
    except Exception as error:
        pytest.skip(f"{model_type}: the tiny config does not build ({type(error).__name__}: {str(error)[:160]})")
    return _mild_decay(model).eval()


def reference_in_float64(model, sequences):
    """``(reference log-probs, log-prob tolerance, gradient tolerance)``: in fp64 where transformers' kernels take
    it; else (grouped expert matmuls) in fp32, as the family tests check."""
    try:
        return per_sequence_logprobs(model.double(), sequences)[0], 1e-6, 1e-5
    except RuntimeError:
        return per_sequence_logprobs(model.float(), sequences)[0], 1e-5, 1e-4


@pytest.mark.parametrize("model_type", sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))
def test_runs_exactly_or_is_refused(model_type):
    warnings.simplefilter("ignore")
    model = build_tiny(model_type)
    try:  # refusal first, so a refused type runs no reference: bigbird_pegasus's fp64 one alone took a process to
        # 8.5 GB resident, and one of CI's pytest workers to 14 GiB of this machine's 24 (2026-12-05)
        apply_tree_patches(model).revert()
    except ValueError as error:  # refused at patch time: the message names the model type or the module
        assert model.config.model_type not in supported_model_types(), str(error)
        assert f"model_type {model.config.model_type!r}" in str(error) or "harts_hf cannot run" in str(error), str(error)
        return
    except Exception:  # noqa: BLE001 - a tiny model that does not run at all: the reference below skips it, and
        pass  # a model that runs gets patched again there, where the same error fails the test
    sequences = chunk_edge_sequences(vocab=VOCAB)
    try:
        reference, value_tol, grad_tol = reference_in_float64(model, sequences)
    except Exception as error:
        pytest.skip(f"{model_type}: the tiny model does not run one sequence at a time ({type(error).__name__}: "
                    f"{str(error)[:160]})")
    handle = apply_tree_patches(model)
    try:
        tree = tree_logprobs(model, sequences).logprobs
        for a, b in zip(tree, reference):
            torch.testing.assert_close(a, b, rtol=value_tol, atol=value_tol)
        weights = [torch.randn(b.shape, generator=torch.Generator().manual_seed(i), dtype=b.dtype)
                   for i, b in enumerate(reference)]
        # the floor at a thousandth of the largest gradient: a router whose top-k weights are renormalised has a
        # gradient that all but vanishes, its relative error rounding alone
        assert_gradients_close(model, sum((x * w).sum() for x, w in zip(tree, weights)),
                               sum((x * w).sum() for x, w in zip(reference, weights)), grad_tol, floor_fraction=1e-3)
    finally:
        handle.revert()
