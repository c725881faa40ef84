"""What patching does to a model besides tree execution: no shared objects changed (signatures, lifetime,
torch.save), every decoder layer's mixer patched or refused, NaN kept inside its sequence, and CPU forwards that
never reach Triton (where triton is installed: CI's triton leg)."""

import gc
import importlib.util
import inspect
import io
import weakref

import pytest
import torch
import transformers
from packaging import version

from harts_hf import tree_logprobs
from harts_hf.model_patches import apply_tree_patches, cpu_safe
from harts_hf.reference import per_sequence_logprobs, torch_reference_kernels
from tests.models import VOCAB, build

SEQUENCES = [[1, 2, 3, 4, 5], [1, 2, 3, 6], [1, 7, 8]]
TRITON = importlib.util.find_spec("triton") is not None
# transformers 5.25 sends CPU inputs of the kernel functions it binds to fla to their PyTorch versions itself
TRANSFORMERS_ROUTES_CPU = version.parse(transformers.__version__) >= version.parse("5.25")


def test_patched_forwards_keep_their_own_signature_and_lifetime():
    first, second = build("qwen3_next"), build("llama")
    expected = [inspect.signature(type(model).forward).parameters.keys() - {"self"} for model in (first, second)]
    handles = [apply_tree_patches(model) for model in (first, second)]
    for patched, names in zip((first, second), expected):
        assert set(inspect.signature(patched.forward).parameters) == names  # TRL reads it (logits_to_keep)
    mixer = handles[0].linear_modules[0]
    assert "cache" in inspect.signature(mixer.forward).parameters
    for handle in handles:
        handle.revert()
    alive = weakref.ref(second)
    del handles, handle, second, patched
    gc.collect()
    assert alive() is None, "a reverted, deleted model must not be kept alive by a patch"


@pytest.mark.parametrize("family", ["qwen3_next", "llama"])
def test_saved_and_loaded_patched_model_runs_tree_forwards(family):
    model = build(family)
    apply_tree_patches(model)
    expected = tree_logprobs(model, SEQUENCES).logprobs
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for got, want in zip(tree_logprobs(loaded, SEQUENCES).logprobs, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert loaded.forward.module is loaded


def test_renamed_or_custom_mixers_are_refused():
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    class RenamedGatedDeltaNet(Qwen3NextGatedDeltaNet):
        pass

    class ShiftMixer(torch.nn.Module):  # a user's token mixer: mixes each token with the one before it
        def forward(self, hidden_states, **kwargs):
            return torch.cat([hidden_states[:, :1], hidden_states[:, :-1]], dim=1), None

    model = build("qwen3_next")
    layer = model.model.layers[0]
    layer.linear_attn = RenamedGatedDeltaNet(model.config, 0)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.linear_attn \(.*RenamedGatedDeltaNet\)"):
        apply_tree_patches(model)
    with pytest.raises(ValueError, match="RenamedGatedDeltaNet"):
        tree_logprobs(model, SEQUENCES)
    model = build("llama")
    model.model.layers[1].self_attn = ShiftMixer()
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn \(.*ShiftMixer\)"):
        apply_tree_patches(model)
    assert not hasattr(model, "_harts_tree_patch")


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_nan_in_one_sequence_stays_in_it(family):
    """A NaN embedding row of a token that only sequence 0 holds: sequence 0 is NaN from that token on, the
    others (siblings in the same tree, and another tree) are exact, on the dense-mask attention path. (Chunked
    linear attention spreads a NaN to the earlier tokens of its 64-token chunk, as transformers' own chunked
    kernel does within a sequence; the tree shares such chunks between siblings.)"""
    model = build(family)
    sequences = [[1, 2, 3, 90, 5, 6], [1, 2, 3, 7, 8], [9, 10, 11]]
    clean = per_sequence_logprobs(model, sequences)[0]
    with torch.no_grad():
        model.get_input_embeddings().weight[90] = float("nan")
    out = tree_logprobs(model, sequences, attention_backend="sdpa")
    assert torch.isnan(out.logprobs[0][3:]).all()
    for got, want in zip(out.logprobs[1:], clean[1:]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not TRITON, reason="needs triton importable (CI runs this file in its triton leg)")
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_cpu_forwards_never_reach_triton(family):
    """With triton installed transformers binds fla's Triton kernels; before 5.25 they fail on CPU tensors ("0
    active drivers"), from 5.25 transformers sends CPU inputs to its PyTorch kernels itself. cpu_safe and
    apply_tree_patches route CPU calls to the PyTorch kernels either way: plain forward, generate, tree forward;
    revert() gives back transformers' binding."""
    model = build(family)
    ids = torch.randint(3, VOCAB, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch_reference_kernels():
        expected = model(ids).logits

    def unpatched_forward():
        if TRANSFORMERS_ROUTES_CPU:
            torch.testing.assert_close(model(ids).logits, expected, rtol=0, atol=0)
        else:
            with pytest.raises(RuntimeError, match="active drivers"):
                model(ids)

    unpatched_forward()
    handle = cpu_safe(model)
    torch.testing.assert_close(model(ids).logits, expected, rtol=0, atol=0)
    assert model.generate(ids, max_new_tokens=4, do_sample=False).shape == (1, 24)
    handle.revert()
    with apply_tree_patches(model):
        torch.testing.assert_close(model(ids).logits, expected, rtol=0, atol=0)
        assert model.generate(ids, max_new_tokens=4, do_sample=False).shape == (1, 24)
        assert all(torch.isfinite(lp).all() for lp in tree_logprobs(model, SEQUENCES).logprobs)
    unpatched_forward()


@pytest.mark.parametrize("first", ["mamba2", "token_modules", "qwen3_next"])
def test_every_family_after_importing_one_family_module_first(first):
    """A user who imports one module of ``harts_hf.model_patches`` first (``mamba2`` for ``SCAN_INPUTS``,
    ``token_modules`` for ``AUTOCAST_EXPERTS``) still gets every family: the families load whatever registered first
    (they were skipped once the registry held anything). A fresh interpreter, so nothing else imported them."""
    import subprocess
    import sys

    code = (f"import harts_hf.model_patches.{first}\n"
            "from harts_hf.model_patches import supported_model_types\n"
            "print(' '.join(supported_model_types()))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    for model_type in ("qwen3_next", "qwen3_5", "kimi_linear", "bailing_hybrid", "olmo_hybrid", "nemotron_h",
                       "llama", "qwen3_moe"):
        assert model_type in out, (first, out)
