"""What gradient checkpointing keeps: decoder layers left out (tree_stored_layers: which layers, the same gradients,
their forwards not run again in the backward), attention outputs kept (tree_keep_attention_outputs: the same
gradients, each attention op run once) and matrix products' outputs kept in chosen layers (keep_matmul_outputs: the
same gradients, no GEMM run again); all kept when checkpointing is enabled again."""

import functools
import inspect
import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from harts_hf import tree_logprobs
from harts_hf.kernels import kept
from harts_hf.model_patches import (
    checkpointed_layers,
    checkpointing,
    keep_attention_outputs,
    keep_matmul_outputs,
    keep_matmul_outputs_within,
    keep_mixer_outputs,
    keep_mixer_outputs_within,
    matmul_output_bytes_per_token,
    mixer_output_bytes_per_token,
    store_layer_activations,
)
from harts_hf.model_patches.checkpointing import _attention_ops, _choose, _matmul_ops
from harts_hf.model_patches.core import tree_mixer_output_width
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
    store_layer_activations(model, 4)  # every layer stored, checkpointing still on: 0 brings them all back
    assert checkpointed_layers(model) == []
    store_layer_activations(model, 0)
    assert checkpointed_layers(model) == [0, 1, 2, 3]


def test_layers_transformers_leaves_out_stay_out():
    """transformers >= 5.25 checkpoints every n-th layer only (``every_n_layers``); harts_hf's settings never put a
    layer it left out back into checkpointing, and their own stored layers come on top."""
    model = build("qwen3_next").train()
    if "every_n_layers" not in inspect.signature(model.activation_checkpointing_enable).parameters:
        pytest.skip("this transformers has no every_n_layers (added in 5.25)")
    keep_attention_outputs(model)  # harts_hf's settings in force, as in a tree trainer
    model.activation_checkpointing_enable(every_n_layers=2)
    assert checkpointed_layers(model) == [0, 2]
    assert store_layer_activations(model, 3) == [1, 2, 3]
    assert checkpointed_layers(model) == [0]
    store_layer_activations(model, 0)
    assert checkpointed_layers(model) == [0, 2]
    model.activation_checkpointing_disable()
    model.activation_checkpointing_enable()  # every layer again
    assert checkpointed_layers(model) == [0, 1, 2, 3]


def test_kept_products_go_to_checkpointed_layers_only():
    """tree_keep_matmul_layers chooses among the layers that run checkpointed: never a stored one (it keeps all
    already), and the choice follows when layers are stored later or transformers leaves some out."""
    model = build("qwen3_next").train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert keep_matmul_outputs(model, 2) == [1, 3]  # the attention layers
    assert store_layer_activations(model, 2) == [1, 3]
    assert model._set_gradient_checkpointing.matmul_layers == [0, 2]  # moved to the layers still checkpointed
    with pytest.raises(ValueError, match=r"tree_keep_matmul_layers=3 exceeds the model's 2 checkpointed decoder "
                                         r"layers \(of 4; 2 stored by tree_stored_layers"):
        keep_matmul_outputs(model, 3)
    assert model._set_gradient_checkpointing.matmul_layers == [0, 2]  # a refused count changes nothing
    store_layer_activations(model, 0)
    assert model._set_gradient_checkpointing.matmul_layers == [1, 3]
    if "every_n_layers" in inspect.signature(model.activation_checkpointing_enable).parameters:  # transformers >= 5.25
        model.activation_checkpointing_enable(every_n_layers=2)  # layers 0 and 2 checkpointed
        assert model._set_gradient_checkpointing.matmul_layers == [0, 2]


def test_kept_products_within_a_memory_budget():
    """keep_matmul_outputs_within: the most layers whose products fit in the GiB at the tokens per forward, by
    matmul_output_bytes_per_token; worked out again when layers are stored."""
    model = build("qwen3_next").train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    per_token, tokens = matmul_output_bytes_per_token(model), 1000
    fits = (per_token[1] + per_token[3]) * tokens  # the two attention layers, exactly
    assert keep_matmul_outputs_within(model, fits / 2**30, tokens) == [1, 3]
    assert keep_matmul_outputs_within(model, (fits - 1) / 2**30, tokens) == [3]  # one byte short: one layer
    assert keep_matmul_outputs_within(model, 0, tokens) == []
    assert keep_matmul_outputs_within(model, 1e6, tokens) == [0, 1, 2, 3]
    store_layer_activations(model, 2)  # the attention layers leave checkpointing: the budget goes to the others
    assert model._set_gradient_checkpointing.matmul_layers == [0, 2]
    with pytest.raises(TypeError, match="tree_keep_matmul_gib"):
        keep_matmul_outputs_within(model, "4", tokens)
    assert keep_matmul_outputs(model, 1) == [2]  # a count replaces the budget
    store_layer_activations(model, 0)
    assert model._set_gradient_checkpointing.matmul_layers == [3]


def test_bad_counts_are_refused():
    model = build("llama")
    with pytest.raises(ValueError, match=r"tree_stored_layers=3 exceeds the model's 2 decoder layers"):
        store_layer_activations(model, 3)
    with pytest.raises(ValueError, match="tree_stored_layers"):
        store_layer_activations(model, -1)


class _CountOps(TorchDispatchMode):
    """Counts the dispatcher calls of the ops in ``ops`` (default: the attention ops)."""

    def __init__(self, ops=None):
        super().__init__()
        self.ops = _attention_ops() if ops is None else ops
        self.calls = self.output_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.ops:
            self.calls += 1
            if isinstance(out, torch.Tensor):  # a matrix product's (attention ops return tuples)
                self.output_bytes += out.numel() * out.element_size()
        return out


def _attention_runs_off_and_kept(model, forest) -> dict:
    """Attention ops run in a fwd+bwd with attention outputs rerun (False) and kept (True); both give the same
    log-probs and gradients."""
    counts, results = {}, {}
    for keep in (False, True):
        keep_attention_outputs(model, keep)
        with _CountOps() as counter:
            results[keep] = _fwd_bwd(model, forest)
        counts[keep] = counter.calls
    for a, b in zip(results[True][0], results[False][0], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for name, grad in results[True][1].items():
        torch.testing.assert_close(grad, results[False][1][name], rtol=1e-6, atol=1e-7, msg=name)
    return counts


@pytest.mark.parametrize("family", ["qwen3_next", "llama"])
def test_kept_attention_outputs_give_the_same_gradients_and_run_attention_once(family):
    model = build(family).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    forest = PrefixForest.from_sequences(random_tree_sequences(random.Random(1), 6, vocab=VOCAB, max_tail=70))
    attention_layers = sum(kind == "full_attention" for kind in getattr(model.config, "layer_types", None)
                           or ["full_attention"] * model.config.num_hidden_layers)
    _fwd_bwd(model, forest)  # patches the model (its patch-time probes run attention too)
    counts = _attention_runs_off_and_kept(model, forest)
    assert counts == {False: 2 * attention_layers, True: attention_layers}  # forward and rerun; forward only
    model.gradient_checkpointing_disable()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with _CountOps() as counter:
        _fwd_bwd(model, forest)
    assert counter.calls == attention_layers  # the policy survives re-enabling
    policy = [isinstance(layer._gradient_checkpointing_func, functools.partial)
              and "context_fn" in layer._gradient_checkpointing_func.keywords for layer in model.model.layers]
    kinds = getattr(model.config, "layer_types", None) or ["full_attention"] * len(policy)
    assert policy == [kind == "full_attention" for kind in kinds]  # not on linear-attention layers: nothing to keep


def test_keep_attention_dispatch_mode_is_active_inside_attention_modules_only():
    """Qwen3-Next with attention outputs kept: selective checkpointing's dispatch mode is active inside the attention
    modules (forward and rerun) and nowhere else: not in any MLP, not in the Gated DeltaNet layers, whose ops then
    dispatch without a Python mode in between. The attention itself still runs once, with the same gradients (the
    test above)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    model = build("qwen3_next").train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    forest = PrefixForest.from_sequences(random_tree_sequences(random.Random(3), 4, vocab=VOCAB, max_tail=40))
    _fwd_bwd(model, forest)  # patches the model
    keep_attention_outputs(model)
    seen = {}

    def probe(name):
        return lambda module, args: seen.setdefault(name, set()).add(len(_get_current_dispatch_mode_stack()))

    for index, layer in enumerate(model.model.layers):
        layer.mlp.register_forward_pre_hook(probe(("mlp", index)))
        mixer = getattr(layer, "self_attn", None) or layer.linear_attn
        first = next(m for m in mixer.children() if isinstance(m, torch.nn.Linear))
        first.register_forward_pre_hook(probe(("mixer", index)))
    _fwd_bwd(model, forest)
    kinds = model.config.layer_types
    assert all(seen[("mlp", i)] == {0} for i in range(len(kinds)))
    assert all(seen[("mixer", i)] == ({1} if kind == "full_attention" else {0}) for i, kind in enumerate(kinds))
    assert not kept.open_calls() and not getattr(checkpointing._deferred, "entered", [])


@pytest.mark.parametrize("family", ["nemotron_h", "falcon_h1", "olmo_hybrid"])
def test_kept_attention_in_other_hybrids_runs_attention_once(family):
    """Mamba-2 and Gated DeltaNet hybrids (attention in some layers; in every layer beside Mamba-2 for Falcon-H1):
    with attention outputs kept each attention op runs once instead of twice, the same log-probs and gradients."""
    model = build(family).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    forest = PrefixForest.from_sequences(random_tree_sequences(random.Random(4), 4, vocab=VOCAB, max_tail=40))
    _fwd_bwd(model, forest)  # patches the model
    counts = _attention_runs_off_and_kept(model, forest)
    assert counts[False] == 2 * counts[True] > 0


@pytest.mark.parametrize("family", ["qwen3_next", "llama"])
def test_kept_matmul_outputs_give_the_same_gradients_and_run_no_gemm_twice(family):
    model = build(family).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    forest = PrefixForest.from_sequences(random_tree_sequences(random.Random(2), 6, vocab=VOCAB, max_tail=70))
    layers = len(model.model.layers)
    _fwd_bwd(model, forest)  # patches the model
    counts, results = {}, {}
    for count in (0, 1, layers, "off"):
        if count == "off":
            keep_matmul_outputs(model, 0)
            model.gradient_checkpointing_disable()
        else:
            assert keep_matmul_outputs(model, count) == _choose(
                getattr(model.config, "layer_types", None) or ["full_attention"] * layers, count)
        with _CountOps(_matmul_ops() - _attention_ops()) as counter:
            results[count] = _fwd_bwd(model, forest)
        counts[count] = counter.calls
    # every layer kept: as many matrix products as without checkpointing; fewer layers: in between
    assert counts["off"] == counts[layers] < counts[1] < counts[0]
    for count in (1, layers, "off"):
        for a, b in zip(results[count][0], results[0][0]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        for name, grad in results[count][1].items():
            torch.testing.assert_close(grad, results[0][1][name], rtol=1e-6, atol=1e-7, msg=name)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    keep_matmul_outputs(model, layers)
    model.gradient_checkpointing_disable()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with _CountOps(_matmul_ops() - _attention_ops()) as counter:
        _fwd_bwd(model, forest)
    assert counter.calls == counts[layers]  # the setting survives re-enabling
    with pytest.raises(ValueError, match=rf"tree_keep_matmul_layers={layers + 1} exceeds the model's {layers} "
                                         "checkpointed decoder layers"):
        keep_matmul_outputs(model, layers + 1)


def test_reentrant_checkpointing_keeps_its_function(caplog):
    model = build("llama").train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    before = model.model.layers[0]._gradient_checkpointing_func
    with caplog.at_level("WARNING", logger=checkpointing.__name__):
        keep_attention_outputs(model)
    assert model.model.layers[0]._gradient_checkpointing_func is before  # selective checkpointing needs non-reentrant
    assert "reentrant checkpointing cannot take: the backward reruns them" in caplog.text  # said, not skipped silently


def test_deep_copy_keeps_its_own_settings():
    import copy

    model = build("qwen3_next").train()
    store_layer_activations(model, 2)
    twin = copy.deepcopy(model)
    twin.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert checkpointed_layers(twin) == [0, 2] and checkpointed_layers(model) == []


def test_matmul_output_bytes_per_token_is_what_the_products_write():
    """The bytes per token counted for each layer are the outputs of the layer's matrix products under bf16
    autocast (the attention's aside): what keep_matmul_outputs keeps in it."""
    model = build("llama").eval()
    tokens = 37
    counted = {}

    def count(index):
        def hook(module, args, output):
            counted[index] = mode.output_bytes - counted.pop(("start", index))
        return hook

    for index, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(lambda m, a, i=index: counted.__setitem__(("start", i), mode.output_bytes))
        layer.register_forward_hook(count(index))
    products = _matmul_ops() - _attention_ops()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), _CountOps(products) as mode:
        model(torch.randint(0, VOCAB, (1, tokens)))
    expected = matmul_output_bytes_per_token(model)
    assert len(expected) == len(model.model.layers) and min(expected) > 0
    assert [counted[i] for i in range(len(expected))] == [b * tokens for b in expected]
    assert matmul_output_bytes_per_token(model, torch.float32) == [2 * b for b in expected]


class _KeptAffine(torch.autograd.Function):
    """A node whose forward body goes through :func:`kept.run` (as the fla nodes' state pass and output stage do):
    ``2 x + 1``, its body's runs counted."""

    runs = 0

    @staticmethod
    def forward(ctx, x):
        def body(x):
            _KeptAffine.runs += 1
            return (x * 2 + 1,)

        return kept.run(body, (x,))[0]

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


@pytest.mark.parametrize("contexts", ["deferred", "matmul"])
@pytest.mark.parametrize("mixers", [False, True])
def test_kept_body_runs_once_under_checkpointing_with_the_same_gradients(mixers, contexts):
    """The policy entered around the bodies alone (``deferred``) or over the whole call (``matmul``: the layers
    keeping their matrix products)."""
    torch.manual_seed(0)
    linear, x = torch.nn.Linear(8, 8), torch.randn(5, 8, requires_grad=True)

    def layer(x):
        return torch.tanh(_KeptAffine.apply(linear(x))).square()

    expected = torch.autograd.grad(layer(x).sum(), [x, *linear.parameters()])
    _KeptAffine.runs = 0
    context = functools.partial(checkpointing._deferred_contexts, attention=False, mixers=mixers) if (
        contexts == "deferred") else functools.partial(checkpointing._matmul_contexts, mixers=mixers)
    out = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False, context_fn=context)
    grads = torch.autograd.grad(out.sum(), [x, *linear.parameters()])
    assert _KeptAffine.runs == (1 if mixers else 2)  # kept: the rerun takes the forward's output back
    for a, b in zip(grads, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not kept.open_calls() and not kept._bodies


def test_kept_body_outside_checkpointing_runs_plainly():
    _KeptAffine.runs = 0
    x = torch.randn(3, requires_grad=True)
    out = _KeptAffine.apply(x)
    torch.testing.assert_close(out, x.detach() * 2 + 1)
    assert _KeptAffine.runs == 1 and not kept._bodies


def test_kept_body_output_never_aliases_an_input():
    x = torch.randn(4)
    (out,) = torch.ops.harts.kept_body([x], _register_body(lambda x: (x.view(2, 2),)))
    assert out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    torch.testing.assert_close(out, x.view(2, 2))


def _register_body(body) -> int:
    number = next(kept._numbers)
    kept._bodies[number] = body
    return number


@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h", "kimi_linear"])
def test_keep_mixer_outputs_opens_the_mixers_to_the_policy(family):
    """The tree mixers of every checkpointed layer run inside an open checkpointed call that keeps their bodies
    (in both passes) once :func:`keep_mixer_outputs` is on, and in none once it is off; log-probs and gradients
    unchanged (on the CPU the torch nodes have no kept body: the fla nodes' are checked under Triton's interpreter,
    scripts/check_fla_nodes_on_cpu.py)."""
    model = build(family).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    forest = PrefixForest.from_sequences(random_tree_sequences(random.Random(5), 4, vocab=VOCAB, max_tail=40))
    reference = _fwd_bwd(model, forest)  # patches the model
    mixers = [m for m in model.modules() if tree_mixer_output_width(m)]
    seen = []
    for mixer in mixers:
        mixer.register_forward_pre_hook(
            lambda module, args: seen.append(bool(kept.open_calls() and kept.open_calls()[-1].mixers)))
    results = {}
    for enable in (True, False):
        keep_mixer_outputs(model, enable)
        seen.clear()
        results[enable] = _fwd_bwd(model, forest)
        assert seen == [enable] * (2 * len(mixers))  # the forward, then the backward's rerun
    for logprobs, grads in results.values():
        for a, b in zip(logprobs, reference[0]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, reference[1][name], rtol=0, atol=0, msg=name)
    width = mixers[0].out_proj.in_features if hasattr(mixers[0], "out_proj") else mixers[0].o_proj.in_features
    per_layer = mixer_output_bytes_per_token(model, torch.bfloat16)
    assert sorted(set(per_layer)) == [0, 2 * width] and per_layer.count(2 * width) == len(mixers)
    with pytest.raises(TypeError, match="tree_keep_mixer_outputs must be True or False"):
        keep_mixer_outputs(model, "yes")


def test_kept_mixer_outputs_within_a_memory_budget():
    """As many checkpointed layers holding a tree mixer as fit, spread evenly; chosen again when the checkpointed
    layers change; 0 GiB none; the hooks see the chosen layers' mixers only."""
    model = build("qwen3_next").train()  # mixers in layers 0 and 2, 64 bytes per token each in bf16
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert mixer_output_bytes_per_token(model) == [64, 0, 64, 0]
    assert keep_mixer_outputs_within(model, 1.5 * 64 * 100 / 2**30, tokens=100) == [2]
    assert keep_mixer_outputs_within(model, 2 * 64 * 100 / 2**30, tokens=100) == [0, 2]
    assert keep_mixer_outputs_within(model, 0.0, tokens=100) == []
    keep_mixer_outputs_within(model, 1.0, tokens=100)
    store_layer_activations(model, 1)  # layer 1 (the first attention layer) leaves checkpointing: no change here
    assert model._set_gradient_checkpointing.mixer_layers == [0, 2]
    store_layer_activations(model, 3)  # layers 1, 3 and one mixer layer stored: the other one stays kept
    stored = model._set_gradient_checkpointing.stored
    assert model._set_gradient_checkpointing.mixer_layers == [i for i in (0, 2) if i not in stored]
    store_layer_activations(model, 0)
    forest = PrefixForest.from_sequences(random_tree_sequences(random.Random(6), 3, vocab=VOCAB, max_tail=30))
    _fwd_bwd(model, forest)  # patches the model
    keep_mixer_outputs_within(model, 1.5 * 64 * 100 / 2**30, tokens=100)
    seen = {}
    for index, layer in enumerate(model.model.layers):
        if tree_mixer_output_width(getattr(layer, "linear_attn", torch.nn.Module())):
            layer.linear_attn.register_forward_pre_hook(lambda module, args, index=index: seen.setdefault(
                index, []).append(bool(kept.open_calls() and kept.open_calls()[-1].mixers)))
    _fwd_bwd(model, forest)
    assert seen == {0: [False, False], 2: [True, True]}
    keep_mixer_outputs(model)  # every such layer again
    assert model._set_gradient_checkpointing.mixer_layers == [0, 2]
    with pytest.raises(ValueError, match="tree_keep_mixer_gib"):
        keep_mixer_outputs_within(model, -1.0, tokens=100)
