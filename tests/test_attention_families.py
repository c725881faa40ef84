"""Full-attention families found by structure (transformers' attention interface, rotary positions): sliding
windows along each path, mixed sliding/full layers, attention and final-logit softcapping, attention sinks, logit
scales, a trust_remote_code model, refusal of logits the tree cannot reproduce; exact against transformers' own model run one sequence at a
time (fp32 CPU)."""

import random

import pytest
import torch
from datasets import Dataset

from harts_hf.kernels import build_varlen_layout, tree_attention, tree_attention_reference
from harts_hf.model_patches import apply_tree_patches
from harts_hf.model_patches.core import attention_interface_family, decoder_layers
from harts_hf.trees import PrefixForest
from tests.forests import chunk_edge_sequences
from tests.models import COMMON as _COMMON
from tests.models import VOCAB, build
from tests.test_tree_logprobs import compare

GENERIC = ["mistral", "mistral_sliding", "phi3", "olmo2", "gemma2", "gemma3_text", "cohere2", "granite", "gpt_oss",
           "glm4_moe", "mixtral", "deepseek_v3", "deepseek_v2", "gpt2", "opt"]


@pytest.mark.parametrize("family", GENERIC)
def test_matches_per_sequence_fp32(family):
    """Forks at depths 0, 1, 63, 64, 65, 127-129 (window 64: window - 1, window, window + 1), nested forks, an
    identical pair and a prefix; log-probs, entropies and every parameter gradient."""
    compare(build(family), chunk_edge_sequences(vocab=VOCAB), grad_tol=1e-4)


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss", "granitemoehybrid"])
def test_load_balancing_loss_weighted_by_multiplicity(family):
    """The family's own load-balancing loss over router rows weighted by multiplicity equals it over the
    per-sequence runs' router rows, and so do its gradients."""
    model = build(family)
    model.config.output_router_logits = True
    compare(model, chunk_edge_sequences(vocab=VOCAB), grad_tol=1e-4, aux=True)


def test_final_logit_softcapping():
    model = build("gemma3_text")
    model.config.final_logit_softcapping = 3.0
    compare(model, chunk_edge_sequences(vocab=VOCAB), grad_tol=1e-4, temperature=0.7)


def test_supported_model_types_list_the_tested_structural_families():
    from harts_hf.model_patches import supported_model_types
    from harts_hf.model_patches.core import TESTED_BY_STRUCTURE

    assert set(TESTED_BY_STRUCTURE) <= set(supported_model_types())
    assert {build(family).config.model_type for family in GENERIC} == set(TESTED_BY_STRUCTURE)


def test_found_by_structure():
    family = attention_interface_family(build("gemma3_text"))
    assert family.generic and family.attention_classes == ("Gemma3Attention",)
    handle = apply_tree_patches(build("mistral_sliding"))
    assert len(handle.attention_modules) == 2
    handle.revert()


@pytest.mark.parametrize("window,softcap,sinks", [(1, None, False), (2, None, False), (63, None, False),
                                                  (64, None, False), (65, None, False), (1000, None, False),
                                                  (None, 0.5, False), (None, None, True), (64, 0.5, True)])
@pytest.mark.parametrize("backend", ["sdpa", "runs"])
def test_attention_features_match_per_path(window, softcap, sinks, backend):
    """Sliding window (a key is visible iff it is an ancestor-or-self less than ``window`` positions above the
    query), logit softcapping and attention sinks: output and every input gradient against causal attention with
    the same features on each path (fp64)."""
    packed = PrefixForest.from_sequences(chunk_edge_sequences()).pack()
    U = packed.num_tokens
    torch.manual_seed(0)
    leaves = [torch.randn(U, h, 8, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2)]
    if sinks:
        leaves.append(torch.randn(4, dtype=torch.float64, requires_grad=True))
    features = dict(window=window, softcap=softcap, sinks=leaves[3] if sinks else None)
    out = tree_attention(*leaves[:3], packed.subtree_end, backend=backend, layout=build_varlen_layout(packed),
                         depth=packed.position_ids, **features)
    weights = torch.randn(out.shape, dtype=torch.float64)
    grads = torch.autograd.grad((out * weights).sum(), leaves)
    expected = torch.zeros_like(out)  # each token's output from the first path through it (all paths agree)
    written = torch.zeros(U, dtype=torch.bool)
    for i, path_out in enumerate(tree_attention_reference(*leaves[:3], packed, **features)):
        index = packed.sequence_index(i)
        new = ~written[index]
        expected = expected.index_copy(0, index[new], path_out[new])
        written[index] = True
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    for a, b in zip(grads, torch.autograd.grad((expected * weights).sum(), leaves)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("value_dim", [4, 12])
@pytest.mark.parametrize("backend, window", [("sdpa", None), ("runs", None), ("sdpa", 64), ("runs", 64)])
def test_value_head_dim_other_than_query_key(value_dim, backend, window):
    """Value heads of another width than query/key heads (multi-head latent attention): output and every input
    gradient against causal attention on each path (fp64); and the zero padding the flash / cuDNN paths use to give
    q, k and v one head dim changes nothing."""
    from harts_hf.kernels.tree_attention.ops import common_head_dim

    packed = PrefixForest.from_sequences(chunk_edge_sequences()).pack()
    U = packed.num_tokens
    torch.manual_seed(0)
    leaves = [torch.randn(U, h, d, dtype=torch.float64, requires_grad=True) for h, d in ((4, 8), (2, 8), (2, value_dim))]
    out = tree_attention(*leaves, packed.subtree_end, backend=backend, layout=build_varlen_layout(packed),
                         depth=packed.position_ids, window=window)
    assert out.shape == (U, 4, value_dim)
    weights = torch.randn(out.shape, dtype=torch.float64)
    expected = torch.zeros_like(out)
    for i, path_out in enumerate(tree_attention_reference(*leaves, packed, window=window)):
        expected = expected.index_copy(0, packed.sequence_index(i), path_out)  # every path agrees on shared tokens
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    grads = torch.autograd.grad((out * weights).sum(), leaves)
    for a, b in zip(grads, torch.autograd.grad((expected * weights).sum(), leaves)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    padded = common_head_dim(*leaves)
    assert {t.shape[-1] for t in padded} == {max(8, value_dim)}
    again = tree_attention(*padded, packed.subtree_end, backend=backend, layout=build_varlen_layout(packed),
                           depth=packed.position_ids, window=window, scaling=8 ** -0.5)[..., :value_dim]
    torch.testing.assert_close(again, out, rtol=1e-12, atol=1e-12)
    for a, b in zip(torch.autograd.grad((again * weights).sum(), leaves), grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_flashattention4_gets_unpadded_values_only_for_checked_widths():
    """FlashAttention-4 gets values narrower than the keys unpadded only for the head-dim pairs checked on a GPU (MLA's
    192 / 128); any other pair keeps the zero padding, decided before FlashAttention-4 is imported (none on the CPU)."""
    from harts_hf.kernels.tree_attention import fa4

    assert fa4.UNPADDED_WIDTHS == {(192, 128)}
    for head_dim, value_dim in ((128, 64), (256, 128), (192, 192), (128, 128)):
        assert fa4.takes_value_width(head_dim, value_dim, 0) is False


def test_window_arguments_are_checked():
    packed = PrefixForest.from_sequences([[1, 2, 3]]).pack()
    q = torch.randn(3, 2, 4)
    with pytest.raises(ValueError, match="window must be a positive int"):
        tree_attention(q, q, q, packed.subtree_end, window=0, depth=packed.position_ids)
    with pytest.raises(ValueError, match="with a window needs depth"):
        tree_attention(q, q, q, packed.subtree_end, backend="sdpa", window=2)
    with pytest.raises(ValueError, match="context keys"):
        tree_attention(q, q, q, packed.subtree_end, window=2, depth=packed.position_ids, context_k=q[:1],
                       context_v=q[:1])


@pytest.mark.parametrize("family", ["mistral_sliding", "phi3", "olmo2", "gemma2", "gemma3_text", "cohere2",
                                    "granite", "gpt_oss", "glm4_moe", "mixtral", "deepseek_v3", "gpt2", "opt", "kimi_linear",
                                    "bailing_hybrid", "olmo_hybrid", "nemotron_h", "bamba", "granitemoehybrid",
                                    "falcon_h1"])
def test_tree_grpo_trainer_matches_grpo_trainer(tmp_path, family):
    """Each family through TreeGRPOTrainer and GRPOTrainer (sliding-window layers at window 8, shorter than the
    rows): one microbatch's loss and every gradient, then two optimizer steps to the same parameters."""
    from tests.test_tree_grpo import assert_same_loss_and_grads, make_trainers
    from tests.trl_helpers import assert_same_training, char_tokenizer

    model = build(family)
    if family == "granitemoehybrid":  # TRL 1.16's own fused forward reads config.num_experts, which Granite spells
        model.config.router_aux_loss_coef = 0.0  # num_local_experts: GRPOTrainer itself fails with the aux loss on
    model.config.sliding_window = 8
    for _, layer in decoder_layers(model):
        if getattr(getattr(layer, "self_attn", None), "sliding_window", None):
            layer.self_attn.sliding_window = 8
    path = tmp_path / "model"
    model.save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    # GPT-2 numbers positions 0.. from the first column when given no position_ids (TRL gives none), so TRL scores a
    # left-padded prompt at positions shifted by its padding; the tree numbers from the first real token, as
    # generation does. The two agree on prompts of one length (no left padding): "12+34=" with two-digit numbers.
    dataset = None
    if family == "gpt2":
        rng = random.Random(0)
        dataset = Dataset.from_dict({"prompt": [f"{rng.randint(10, 99)}+{rng.randint(10, 99)}=" for _ in range(8)]})
    base, tree = make_trainers(str(path), tmp_path / "out", dataset=dataset)
    assert_same_loss_and_grads(base, tree)
    base, tree = make_trainers(str(path), tmp_path / "steps", max_steps=2, per_device_train_batch_size=6,
                               gradient_accumulation_steps=2, dataset=dataset)
    assert_same_training(base, tree)


REMOTE_CONFIG = """from transformers import LlamaConfig


class RemoteConfig(LlamaConfig):
    model_type = "remote_llama"
"""
REMOTE_MODEL = """import torch
from transformers import LlamaForCausalLM

from .configuration_remote import RemoteConfig


class RemoteForCausalLM(LlamaForCausalLM):
    config_class = RemoteConfig


class ScaledRemoteForCausalLM(LlamaForCausalLM):  # post-processes its logits in its own forward
    config_class = RemoteConfig

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 2
        return out
"""


def _remote_model(tmp_path, class_name):
    import json

    import transformers

    path = tmp_path / class_name
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**_COMMON, num_hidden_layers=2)).save_pretrained(path)
    (path / "configuration_remote.py").write_text(REMOTE_CONFIG)
    (path / "modeling_remote.py").write_text(REMOTE_MODEL)
    config = json.loads((path / "config.json").read_text())
    config.update(model_type="remote_llama", architectures=[class_name], auto_map={
        "AutoConfig": "configuration_remote.RemoteConfig", "AutoModelForCausalLM": f"modeling_remote.{class_name}"})
    (path / "config.json").write_text(json.dumps(config))
    return transformers.AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32).eval()


def test_trust_remote_code_model(tmp_path):
    """A model whose classes come from its own directory (trust_remote_code) runs on trees by its structure."""
    model = _remote_model(tmp_path, "RemoteForCausalLM")
    assert type(model).__module__.startswith("transformers_modules") and model.config.model_type == "remote_llama"
    compare(model, chunk_edge_sequences(vocab=VOCAB), grad_tol=1e-4)


def test_logits_the_tree_cannot_reproduce_are_refused(tmp_path):
    model = _remote_model(tmp_path, "ScaledRemoteForCausalLM")
    with pytest.raises(ValueError, match="model_type 'remote_llama': the model's forward turns the LM head's output "
                                         r"into logits in a way harts_hf does not reproduce .*use_tree=False"):
        apply_tree_patches(model)


def _positions_ignored(module, original_forward, x, position_ids):
    """A rotary embedding that numbers the packed row 0..n-1 whatever ``position_ids`` say."""
    return original_forward(x, torch.arange(position_ids.shape[-1]).expand_as(position_ids))


def test_model_whose_tree_forward_differs_is_refused_at_patch_time():
    """A model found by its structure whose layers read positions another way (here: the rotary embedding ignores
    ``position_ids``) passes the structural checks; the patch-time probe against one-sequence runs refuses it, and
    the model is left as it was."""
    from harts_hf.model_patches.core import PatchedForward

    model = build("mistral")
    with torch.no_grad():  # sharp attention, so that positions matter beyond the probe's tolerance
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(30)
            layer.self_attn.k_proj.weight.mul_(30)
    rotary = model.model.rotary_emb
    rotary.forward = PatchedForward(rotary, rotary.forward, _positions_ignored)
    before = model(input_ids=torch.arange(5).unsqueeze(0)).logits
    with pytest.raises(ValueError, match=r"model_type 'mistral' \(found by its structure\) gives other log-probs on a "
                                         r"prefix forest than one sequence at a time \(max difference .*use_tree=False"):
        apply_tree_patches(model)
    assert not isinstance(model.forward, PatchedForward) and not hasattr(model, "_harts_tree_patch")
    torch.testing.assert_close(model(input_ids=torch.arange(5).unsqueeze(0)).logits, before, rtol=0, atol=0)


def test_half_precision_model_found_by_structure_is_probed_for_running_only():
    """In bf16 the probe's log-probs are not compared (rounding differs between the two paths); it runs the tree."""
    handle = apply_tree_patches(build("mistral", dtype=torch.bfloat16))
    assert handle.active
    handle.revert()


def test_attention_call_without_the_tree_during_a_tree_forward_raises():
    """A mixer whose forward does not pass its keyword arguments on (transformers' StableLM and Nemotron attention)
    would run its original attention over the packed forest as one sequence: it raises, naming the module."""
    from harts_hf import tree_logprobs

    model = build("llama")
    apply_tree_patches(model)
    attention = model.model.layers[1].self_attn
    original = attention.forward

    def forward_dropping_kwargs(hidden_states, position_embeddings, attention_mask, **kwargs):
        return original(hidden_states, position_embeddings, attention_mask)

    attention.forward = forward_dropping_kwargs
    with pytest.raises(ValueError, match=r"modeling_llama\.LlamaAttention called transformers' attention function "
                                         r"without the 'harts_tree' keyword argument during a tree forward"):
        tree_logprobs(model, [[1, 2, 3], [1, 2, 4]])
    assert model.model.layers[1](torch.randn(1, 3, 32), position_embeddings=model.model.rotary_emb(
        torch.randn(1, 3, 32), torch.arange(3).unsqueeze(0)), attention_mask=None) is not None  # plain calls still run
