"""apply_tree_patches: bad input, a contract on every private transformers name the patches use, and a
scaled-down agentic (swe preset) batch matching per-sequence runs."""

import inspect

import pytest
import torch
import transformers

from harts_hf import tree_logprobs
from harts_hf.model_patches import apply_tree_patches, supported_model_types
from harts_hf.model_patches.cpu_kernels import torch_function_of
from harts_hf.workloads import make_workload
from tests.models import VOCAB, build


def test_unsupported_model_type_lists_supported_ones():
    config = transformers.BloomConfig(vocab_size=50, hidden_size=16, n_layer=1, n_head=2)  # ALiBi: positions from the mask
    with pytest.raises(ValueError) as info:
        apply_tree_patches(transformers.BloomForCausalLM(config))
    message = str(info.value)
    assert "'bloom'" in message and "use_tree=False" in message
    for model_type in ("qwen3_next", "qwen3_5", "qwen3_5_moe", "llama", "qwen2", "qwen3"):
        assert model_type in message
    assert set(supported_model_types()) >= {"qwen3_next", "qwen3_5", "qwen3_5_text", "llama", "qwen2", "qwen3"}


def test_bad_sequences():
    model = build("qwen3_next")
    with pytest.raises(ValueError, match="max_position_embeddings"):
        tree_logprobs(model, [[1] * 513])
    with pytest.raises(ValueError, match="vocabulary size 97"):
        tree_logprobs(model, [[1, 2, VOCAB]])
    with pytest.raises(ValueError, match="sequences\\[1\\]"):
        tree_logprobs(model, [[1, 2], []])
    with pytest.raises(ValueError, match="temperature"):
        tree_logprobs(model, [[1, 2]], temperature=0.0)


def test_attention_dropout_in_training_is_refused():
    model = build("qwen3_5")
    for module in model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.1
    model.train()
    with pytest.raises(ValueError, match="attention dropout"):
        tree_logprobs(model, [[1, 2, 3], [1, 2, 4]])
    model.eval()
    tree_logprobs(model, [[1, 2, 3], [1, 2, 4]])  # dropout is off in eval mode


def test_double_patch_and_cache_are_refused():
    model = build("qwen3_next")
    handle = apply_tree_patches(model)
    with pytest.raises(RuntimeError, match="already patched"):
        apply_tree_patches(model)
    handle.revert()
    apply_tree_patches(model).revert()


def test_swe_preset_batch_matches_per_sequence():
    from harts_hf.reference import per_sequence_logprobs

    workload = make_workload("swe", scale=0.005, seed=0)
    sequences = [[token % VOCAB for token in sequence] for sequence in workload.sequences]
    model = build("qwen3_next", seed=1)
    tree = tree_logprobs(model, sequences)
    reference, _, _ = per_sequence_logprobs(model, sequences)
    assert tree.stats["R_tok"] > 3
    worst = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(tree.logprobs, reference))
    assert worst < 1e-5


# ---------------------------------------------------------------------------- contract with transformers
GDN_ATTRIBUTES = ("conv1d", "A_log", "dt_bias", "norm", "out_proj", "key_dim", "value_dim", "head_k_dim",
                  "head_v_dim", "activation")
FAMILY_CONTRACT = {
    "transformers.models.qwen3_next.modeling_qwen3_next": (
        "Qwen3NextGatedDeltaNet", ("in_proj_qkvz", "in_proj_ba", "fix_query_key_value_ordering"), "Qwen3NextAttention"),
    "transformers.models.qwen3_5.modeling_qwen3_5": (
        "Qwen3_5GatedDeltaNet", ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"), "Qwen3_5Attention"),
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe": (
        "Qwen3_5MoeGatedDeltaNet", ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"), "Qwen3_5MoeAttention"),
}


@pytest.mark.parametrize("module_name", list(FAMILY_CONTRACT))
def test_transformers_contract(module_name):
    import importlib

    module = importlib.import_module(module_name)
    gdn_name, projections, attention_name = FAMILY_CONTRACT[module_name]
    gdn_class, attention_class = getattr(module, gdn_name), getattr(module, attention_name)
    source = inspect.getsource(gdn_class)
    for name in GDN_ATTRIBUTES + projections:
        assert f"self.{name}" in source or f"def {name}" in source, f"{gdn_name}.{name} is gone"
    assert "config._attn_implementation" in inspect.getsource(attention_class.forward)
    assert callable(module.eager_attention_forward)
    # the pure-torch kernels stay reachable behind transformers' kernel decorators (a plain wrapper, or one inside
    # the ``kernels`` package's Func module from transformers 5.25)
    for function in ("torch_chunk_gated_delta_rule", "causal_conv1d_fn"):
        assert callable(torch_function_of(getattr(module, function))), function
    if hasattr(module, "load_balancing_loss_func"):  # MoE families: the aux loss is reweighted by multiplicity
        parameters = list(inspect.signature(module.load_balancing_loss_func).parameters)
        assert parameters[:4] == ["gate_logits", "num_experts", "top_k", "attention_mask"]


def test_transformers_generic_contract():
    from transformers import masking_utils
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert "harts_tree" in ALL_ATTENTION_FUNCTIONS  # registered through the official AttentionInterface
    assert callable(ALL_ATTENTION_FUNCTIONS.get_interface)
    # a 4-D mask passes through mask creation untouched (the tree forward's placeholder relies on it)
    model = build("llama")
    placeholder = torch.empty(1, 1, 0, 0, dtype=torch.bool)
    cache_name = "cache" if "cache" in inspect.signature(masking_utils.create_causal_mask).parameters else "past_key_values"
    mask = masking_utils.create_causal_mask(config=model.config, inputs_embeds=torch.zeros(1, 5, 32),
                                            attention_mask=placeholder, position_ids=torch.arange(5)[None],
                                            **{cache_name: None})
    assert mask is placeholder
    assert callable(transformers.PreTrainedModel.get_decoder)


def test_zero3_gathers_the_parameters_read_outside_their_module(monkeypatch):
    """Under DeepSpeed ZeRO-3 the patch registers the parameters the tree path reads inside another module's
    forward as that module's external parameters: each Gated DeltaNet mixer's conv weight/bias and gated norm weight
    (its forward runs per row block), and the LM head on the model (the chunked head reads its weight directly
    under ZeRO-3). A recording stand-in for
    ``deepspeed.zero`` checks the calls here; tests/test_deepspeed.py trains with the real DeepSpeed (CI's venv)."""
    import sys
    import types

    import transformers.integrations

    calls = []
    fake = types.ModuleType("deepspeed")
    fake.zero = types.SimpleNamespace(register_external_parameter=lambda module, p: calls.append((module, p)))
    monkeypatch.setitem(sys.modules, "deepspeed", fake)
    monkeypatch.setattr(transformers.integrations, "is_deepspeed_zero3_enabled", lambda: True)
    model = build("qwen3_next")
    handle = apply_tree_patches(model)
    mixers = handle.linear_modules
    expected = {(id(m), id(p)) for m in mixers for p in (m.conv1d.weight, m.conv1d.bias, m.norm.weight) if p is not None}
    expected.add((id(model), id(model.get_output_embeddings().weight)))
    assert {(id(m), id(p)) for m, p in calls} == expected and mixers
    handle.revert()


def test_qwen3_next_projection_in_weight_row_order_is_transformers_split():
    """Qwen3-Next's tree projection reads in_proj_qkvz / in_proj_ba's weight rows in q, k, v, z / b, a order (no
    activation reordering); a wrapped projection (a hook here, PEFT's layers alike) runs its own forward instead.
    Both give transformers' fix_query_key_value_ordering split, bit for bit."""
    from harts_hf.model_patches.core import plain_linear
    from harts_hf.model_patches.qwen3_next import _project

    model = build("qwen3_next")
    module = next(m for m in model.modules() if type(m).__name__ == "Qwen3NextGatedDeltaNet")
    assert module.num_v_heads > module.num_k_heads  # several value heads per key-head group
    x = torch.randn(1, 9, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    assert plain_linear(module.in_proj_qkvz)
    fast = _project(module, x)
    module.in_proj_qkvz.register_forward_hook(lambda *args: None)
    assert not plain_linear(module.in_proj_qkvz)
    for got, expected in zip(fast, _project(module, x)):
        assert torch.equal(got, expected)
