"""Bad arguments of the public entry points fail early, naming the argument, the value and what is expected; the
inputs that are right (numpy integers, path-likes, tensor labels, set_attn_implementation while patched) work."""

import json
import re

import numpy as np
import pytest
import torch
import transformers
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from harts_hf import TreeGRPOConfig, tree_logprobs
from harts_hf.kernels import TreeMetadata, build_gated_delta_plan
from harts_hf.kernels.chunked_logprobs import chunked_logprobs
from harts_hf.model_patches import apply_tree_patches, cpu_safe
from harts_hf.planner import CostModel, execute_plan, plan
from harts_hf.trees import PrefixForest
from tests.models import COMMON, build

SEQUENCES = [[1, 2, 3, 4], [1, 2, 5], [1, 2, 3, 6, 7]]


def raises(error, *words):
    """``pytest.raises`` whose message must hold every one of ``words`` (literally)."""
    return pytest.raises(error, match="(?s)" + "".join(f"(?=.*{re.escape(word)})" for word in words))


def is_patched(model) -> bool:
    return getattr(model, "_harts_tree_patch", None) is not None or "forward" in vars(model)


def test_temperature_must_be_finite_and_positive():
    model = build("llama")
    for bad in (float("nan"), float("inf"), -float("inf"), 0.0, -1.0):
        with raises(ValueError, "tree_logprobs: temperature must be a finite number > 0", repr(bad)):
            tree_logprobs(model, SEQUENCES, temperature=bad)
    with raises(TypeError, "tree_logprobs: temperature", "'1.0'", "str"):
        tree_logprobs(model, SEQUENCES, temperature="1.0")
    assert not is_patched(model)  # refused before anything was patched
    the_plan = plan(SEQUENCES, token_budget=100)
    with raises(ValueError, "execute_plan: temperature", "nan"):
        execute_plan(model, the_plan, temperature=float("nan"))
    head, hidden, labels = torch.nn.Linear(8, 11), torch.randn(5, 8), torch.randint(0, 11, (5,))
    with raises(ValueError, "chunked_logprobs: temperature", "inf"):
        chunked_logprobs(head, hidden, labels, temperature=float("inf"))


def test_head_chunk_size_must_be_a_positive_integer():
    model = build("llama")
    for bad in (0, -4):
        with raises(ValueError, "tree_logprobs: head_chunk_size must be an integer >= 1", f"got {bad}"):
            tree_logprobs(model, SEQUENCES, head_chunk_size=bad)
    for bad in (2.5, True, "64"):
        with raises(TypeError, "tree_logprobs: head_chunk_size", repr(bad)):
            tree_logprobs(model, SEQUENCES, head_chunk_size=bad)
    assert not is_patched(model)
    with raises(ValueError, "execute_plan: head_chunk_size", "got 0"):
        execute_plan(model, plan(SEQUENCES, token_budget=100), head_chunk_size=0)
    head, hidden, labels = torch.nn.Linear(8, 11), torch.randn(5, 8), torch.randint(0, 11, (5,))
    for bad in (0, -4):
        with raises(ValueError, "chunked_logprobs: chunk_size", f"got {bad}"):
            chunked_logprobs(head, hidden, labels, chunk_size=bad)
    # a numpy integer is an integer
    expected = tree_logprobs(model, SEQUENCES).logprobs
    for got, want in zip(tree_logprobs(model, SEQUENCES, head_chunk_size=np.int64(2)).logprobs, expected):
        torch.testing.assert_close(got, want)


def config(tmp_path, **fields):
    return TreeGRPOConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True, report_to="none", **fields)


@pytest.mark.parametrize("field", ["use_tree", "tree_share_across_groups", "tree_keep_groups_together",
                                   "tree_balance_replicas", "tree_cross_replica_handoffs"])
def test_config_bool_fields_refuse_strings_ints_and_none(tmp_path, field):
    for bad in ("False", "true", 0, 1, None):
        with raises(TypeError, f"{field} must be True or False", f"got {bad!r}"):
            config(tmp_path, **{field: bad})


@pytest.mark.parametrize("field", ["tree_shared_keys_in_place", "tree_executed_mixers"])
def test_config_optional_bool_field_refuses_strings_and_ints(tmp_path, field):
    for bad in ("False", "yes", 0, 1):
        with raises(TypeError, f"{field} (or None) must be True or False", f"got {bad!r}"):
            config(tmp_path, **{field: bad})
    for good in (None, True, False):
        assert getattr(config(tmp_path, **{field: good}), field) is good


def test_config_integer_and_path_fields_are_type_checked(tmp_path):
    for bad in ("100", 1.5, True, 100.0):
        with raises(TypeError, "tree_token_budget must be an integer >= 1 or None", f"got {bad!r}"):
            config(tmp_path, tree_token_budget=bad)
    for bad in ("4096", 4096.0, None, False):
        with raises(TypeError, "tree_head_chunk_size must be an integer >= 1", f"got {bad!r}"):
            config(tmp_path, tree_head_chunk_size=bad)
    with raises(ValueError, "tree_head_chunk_size must be an integer >= 1", "got -4"):
        config(tmp_path, tree_head_chunk_size=-4)
    for bad in (5, True):
        with raises(TypeError, "tree_cost_model must be a path", repr(bad)):
            config(tmp_path, tree_cost_model=bad)
    # None where None is meant, numpy integers as ints, a pathlib path as its string
    CostModel().save(tmp_path / "cost.json")
    args = config(tmp_path, tree_token_budget=np.int64(100), tree_head_chunk_size=np.int32(64),
                  tree_cost_model=tmp_path / "cost.json")
    assert type(args.tree_token_budget) is int and type(args.tree_head_chunk_size) is int
    assert args.tree_cost_model == str(tmp_path / "cost.json")
    assert config(tmp_path, tree_token_budget=None, tree_cost_model=None).tree_token_budget is None


def test_cost_model_coefficients_must_be_finite_and_non_negative(tmp_path):
    for name in ("unique_tokens", "attention_pairs", "replay_tokens", "rounds", "leaves", "microbatches"):
        for bad in (float("nan"), float("inf"), -1.0, -1e-9):
            with raises(ValueError, f"CostModel: {name} must be a finite number >= 0", f"got {bad!r}"):
                CostModel(**{name: bad})
        for bad in ("0.1", None, True):
            with raises(TypeError, f"CostModel: {name} must be a finite number >= 0", repr(bad)):
                CostModel(**{name: bad})
    assert CostModel(rounds=0, leaves=np.float32(0.5)).cost({"rounds": 2, "leaves": 2}) == 1.0
    path = tmp_path / "cost.json"
    path.write_text(json.dumps({"unique_tokens": "fast"}))
    with raises(TypeError, "CostModel: unique_tokens", "'fast'"):
        CostModel.load(path)
    with raises(ValueError, "tree_cost_model=", "CostModel: unique_tokens", "'fast'"):
        config(tmp_path, tree_cost_model=str(path))
    path.write_text("{\"leaves\": NaN}")
    with raises(ValueError, "tree_cost_model=", "CostModel: leaves", "nan"):
        config(tmp_path, tree_cost_model=str(path))
    path.write_text(json.dumps({"leaf": 1.0}))
    with raises(ValueError, "CostModel.load", "'leaf'"):
        CostModel.load(path)


def test_plan_takes_numpy_integers_and_refuses_bools():
    reference = plan(SEQUENCES, token_budget=100, num_replicas=2, pieces_per_replica=4)
    numpy_plan = plan(SEQUENCES, token_budget=np.int64(100), num_replicas=np.int32(2), chunk_size=np.int64(64),
                      pieces_per_replica=np.uint8(4))
    assert numpy_plan.token_budget == 100 and type(numpy_plan.token_budget) is int
    assert numpy_plan.stats() == reference.stats()
    for name in ("token_budget", "num_replicas", "chunk_size", "pieces_per_replica"):
        for bad in (True, 2.0, "100"):
            with raises(TypeError, f"plan: {name} must be an integer", repr(bad)):
                plan(SEQUENCES, **{"token_budget": 100, name: bad})
    for name, bad in (("token_budget", 0), ("num_replicas", 0), ("chunk_size", -64), ("pieces_per_replica", -1)):
        with raises(ValueError, f"plan: {name} must be an integer >=", f"got {bad}"):
            plan(SEQUENCES, **{"token_budget": 100, name: bad})
    with raises(TypeError, "plan: cross_replica must be True or False", "'no'"):
        plan(SEQUENCES, token_budget=100, cross_replica="no")
    with raises(TypeError, "plan: cost_model must be a CostModel or None", "dict"):
        plan(SEQUENCES, token_budget=100, cost_model={"leaves": 1.0})


def test_execute_plan_replica_is_an_integer_not_a_bool():
    model = build("llama")
    the_plan = plan(SEQUENCES, token_budget=100, num_replicas=2, cross_replica=False)
    with raises(TypeError, "execute_plan: replica must be an integer >= 0 or None", "got True"):
        execute_plan(model, the_plan, replica=True)
    with raises(ValueError, "execute_plan: replica must be an integer >= 0", "got -1"):
        execute_plan(model, the_plan, replica=-1)
    by_numpy, by_int = (execute_plan(model, the_plan, replica=r) for r in (np.int64(1), 1))
    torch.testing.assert_close(by_numpy.token_logprobs, by_int.token_logprobs)


def test_gated_delta_chunk_size_must_be_positive():
    packed = PrefixForest.from_sequences(SEQUENCES).pack()
    for bad in (0, -64):
        with raises(ValueError, "TreeMetadata: chunk_size must be an integer >= 1", f"got {bad}"):
            TreeMetadata(packed, "cpu", chunk_size=bad)
        with raises(ValueError, "build_gated_delta_plan: chunk_size must be an integer >= 1", f"got {bad}"):
            build_gated_delta_plan(packed, chunk_size=bad)
        with raises(ValueError, "PackedForest.stats: chunk_size must be an integer >= 1", f"got {bad}"):
            packed.stats(chunk_size=bad)
        with raises(ValueError, "plan: chunk_size must be an integer >= 1", f"got {bad}"):
            plan(packed, token_budget=100, chunk_size=bad)
    with raises(TypeError, "TreeMetadata: chunk_size", "64.0"):
        TreeMetadata(packed, "cpu", chunk_size=64.0)


def test_model_without_lm_head_is_refused_before_patching():
    model = transformers.LlamaModel(transformers.LlamaConfig(**COMMON, num_hidden_layers=2)).eval()
    assert model.get_output_embeddings() is None
    for call in (lambda: tree_logprobs(model, SEQUENCES), lambda: apply_tree_patches(model)):
        with raises(ValueError, "LlamaModel has no LM head", "AutoModelForCausalLM"):
            call()
        assert not is_patched(model)
        assert all(module.config is model.config for module in model.modules() if hasattr(module, "config"))


def test_out_of_range_token_ids_name_the_sequence_and_value():
    big = 2**63
    cases = [[big], [1, 2**64], np.array([3, big], dtype=np.uint64), torch.tensor([big], dtype=torch.uint64),
             [np.uint64(big + 5), 1], [1, 2, -2**70], [4, -100]]
    for sequence in cases:
        values = [int(x) for x in (sequence.numpy() if isinstance(sequence, torch.Tensor) else sequence)]
        position = next(p for p, x in enumerate(values) if not 0 <= x < big)
        with raises(ValueError, f"sequences[1][{position}] = {values[position]}",
                    "negative" if values[position] < 0 else "too large"):
            PrefixForest.from_sequences([[1, 2], sequence])
    edge = PrefixForest.from_sequences([[big - 1, 0], np.array([big - 1], dtype=np.uint64)]).pack()
    assert edge.input_ids.tolist() == [big - 1, 0] and edge.num_tokens == 2


def test_group_labels_must_be_hashable():
    with raises(TypeError, "from_sequences: groups[1] is [7] of type list", "hashable"):
        PrefixForest.from_sequences([[1, 2], [1, 3]], groups=[0, [7]])
    with raises(TypeError, "groups[0]", "dict"):
        PrefixForest.from_sequences([[1, 2]], groups=[{}])
    # tensor and array labels group by value (0-d tensors hash by identity)
    for groups in (torch.tensor([0, 0, 1]), np.array([0, 0, 1])):
        forest = PrefixForest.from_sequences([[1, 2], [1, 3], [1, 4]], groups=groups)
        assert forest.pack().num_tokens == 5  # the first two share token 1, the third is its own tree


_SPY_CALLS: list = []


def _spy_attention(module, *args, **kwargs):
    _SPY_CALLS.append(type(module).__name__)
    return sdpa_attention_forward(module, *args, **kwargs)


AttentionInterface.register("harts_test_spy", _spy_attention)


@pytest.mark.parametrize("family", ["llama", "qwen3_5_vl"])
def test_set_attn_implementation_takes_effect_while_patched(family):
    model = cpu_safe(build(family)).model  # CPU forwards on PyTorch kernels also where triton is installed
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    expected_logits = model(input_ids=ids).logits
    handle = apply_tree_patches(model)
    expected = tree_logprobs(model, SEQUENCES).logprobs
    model.set_attn_implementation("harts_test_spy")
    _SPY_CALLS.clear()
    torch.testing.assert_close(model(input_ids=ids).logits, expected_logits)
    assert len(_SPY_CALLS) == 2  # both tiny models have two softmax-attention layers
    _SPY_CALLS.clear()
    for got, want in zip(tree_logprobs(model, SEQUENCES).logprobs, expected):  # tree calls keep the tree kernel
        torch.testing.assert_close(got, want)
    assert _SPY_CALLS == []
    model.set_attn_implementation("eager")
    torch.testing.assert_close(model(input_ids=ids).logits, expected_logits)
    assert _SPY_CALLS == []
    handle.revert()
    assert model.config.get_text_config()._attn_implementation == "eager"
