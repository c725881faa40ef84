"""Decoder layers left out of gradient checkpointing (tree_stored_layers): which layers, the same gradients, the
layers' forwards not run again in the backward, kept out when checkpointing is enabled again."""

import random

import pytest
import torch

from harts_hf import tree_logprobs
from harts_hf.model_patches import checkpointed_layers, store_layer_activations
from harts_hf.model_patches.stored_layers import _choose
from harts_hf.trees import PrefixForest
from tests.forests import random_tree_sequences
from tests.models import VOCAB, build

HYBRID = ["linear_attention", "full_attention"] * 4


@pytest.mark.parametrize("layer_types, count, expected", [
    (HYBRID, 0, []),
    (HYBRID, 2, [3, 7]),
    (HYBRID, 4, [1, 3, 5, 7]),
    (HYBRID, 5, [1, 3, 4, 5, 7]),
    (HYBRID, 8, list(range(8))),
    (["full_attention"] * 6, 2, [1, 4]),
    (["full_attention"] * 6, 3, [1, 3, 5]),
])
def test_attention_layers_first_then_spread(layer_types, count, expected):
    assert _choose(layer_types, count) == expected


def _fwd_bwd(model, forest):
    model.zero_grad(set_to_none=True)
    out = tree_logprobs(model, forest=forest)
    sum((lp * (1 + torch.arange(lp.numel()) % 3)).sum() for lp in out.logprobs).backward()
    return [lp.detach() for lp in out.logprobs], {n: p.grad.clone() for n, p in model.named_parameters()
                                                  if p.grad is not None}


@pytest.mark.parametrize("family, count", [("qwen3_next", 2), ("qwen3_next", 4), ("llama", 1)])
def test_same_gradients_and_no_second_forward(family, count):
    model = build(family).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    forest = PrefixForest.from_sequences(random_tree_sequences(random.Random(0), 6, vocab=VOCAB, max_tail=70))
    reference = _fwd_bwd(model, forest)
    stored = store_layer_activations(model, count)
    layers = model.model.layers
    assert checkpointed_layers(model) == [i for i in range(len(layers)) if i not in stored]
    calls = [0] * len(layers)
    hooks = [layer.mlp.register_forward_pre_hook(lambda m, a, i=i: calls.__setitem__(i, calls[i] + 1))
             for i, layer in enumerate(layers)]
    logprobs, grads = _fwd_bwd(model, forest)
    for hook in hooks:
        hook.remove()
    assert calls == [1 if i in stored else 2 for i in range(len(layers))]  # a checkpointed layer runs again
    for a, b in zip(logprobs, reference[0]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert grads.keys() == reference[1].keys()
    for name in grads:
        torch.testing.assert_close(grads[name], reference[1][name], rtol=1e-5, atol=1e-6, msg=name)


def test_kept_out_when_checkpointing_is_enabled_again_and_reset_by_zero():
    model = build("qwen3_next").train()
    assert store_layer_activations(model, 2) == [1, 3]
    assert checkpointed_layers(model) == []  # checkpointing is off: nothing to leave out
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert checkpointed_layers(model) == [0, 2]
    model.gradient_checkpointing_disable()
    assert checkpointed_layers(model) == []
    model.gradient_checkpointing_enable()
    assert checkpointed_layers(model) == [0, 2]
    store_layer_activations(model, 0)
    assert checkpointed_layers(model) == [0, 1, 2, 3]


def test_bad_counts_are_refused():
    model = build("llama")
    with pytest.raises(ValueError, match=r"tree_stored_layers=3 exceeds the model's 2 decoder layers"):
        store_layer_activations(model, 3)
    with pytest.raises(ValueError, match="tree_stored_layers"):
        store_layer_activations(model, -1)
