"""tree_logprobs against transformers' own model run one sequence at a time (pure-torch path), CPU.

Tolerances (documented in the README): fp32 log-probs and entropies to 1e-5 relative; fp32 parameter
gradients to 1e-4 in relative norm (A_log / dt_bias gradients are sums of many cancelling terms: the fp32
reference itself moves by ~1e-5 there); fp64 gradients to 1e-5 with transformers' default A init (transformers' gated RMSNorm and MoE routing
still round to fp32 inside).
"""

import random

import pytest
import torch

from harts_hf import tree_logprobs
from harts_hf.model_patches import apply_tree_patches
from harts_hf.reference import per_sequence_logprobs, torch_reference_kernels
from tests.forests import chunk_edge_sequences, random_tree_sequences
from tests.models import FAMILIES, VOCAB, build

MOE_FAMILIES = {"qwen3_next_moe", "qwen3_5_moe", "qwen3_moe"}


def assert_gradients_close(model, tree_objective, reference_objective, grad_tol, floor_fraction=1e-5) -> float:
    """Every parameter gradient of ``tree_objective`` within ``grad_tol`` of ``reference_objective``'s, relative to
    the reference gradient's norm or, where that is under ``floor_fraction`` of the largest one, to that floor: a key
    projection's bias has gradient zero in exact arithmetic (softmax ignores a constant added to one query's scores),
    so its own norm is rounding. Returns the worst relative error."""
    params = [p for p in model.parameters() if p.requires_grad]
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    tree_grads = torch.autograd.grad(tree_objective, params, allow_unused=True)
    ref_grads = torch.autograd.grad(reference_objective, params, allow_unused=True)
    floor = floor_fraction * max(b.norm() for b in ref_grads if b is not None)
    worst = 0.0
    for name, a, b in zip(names, tree_grads, ref_grads):
        assert (a is None) == (b is None), name
        if b is None or b.norm() == 0:
            continue
        error = ((a - b).norm() / max(b.norm(), floor)).item()
        worst = max(worst, error)
        assert error <= grad_tol, f"{name}: relative gradient error {error:.2e} > {grad_tol:.0e}"
    return worst


def compare(model, sequences, *, grad_tol, value_tol=1e-5, float64_recurrence=False, entropy=True,
            temperature=1.0, aux=False):
    tree = tree_logprobs(model, sequences, compute_entropy=entropy, return_aux_loss=aux, temperature=temperature)
    ref_logprobs, ref_entropies, ref_aux = per_sequence_logprobs(
        model, sequences, compute_entropy=entropy, return_aux_loss=aux, temperature=temperature,
        float64_recurrence=float64_recurrence)
    for a, b in zip(tree.logprobs, ref_logprobs):
        torch.testing.assert_close(a, b, rtol=value_tol, atol=value_tol)
    if entropy:
        for a, b in zip(tree.entropies, ref_entropies):
            torch.testing.assert_close(a, b, rtol=value_tol, atol=value_tol)
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(b.shape, generator=generator, dtype=b.dtype) for b in ref_logprobs]

    def objective(logprobs, entropies, aux_loss):
        total = sum((x * w).sum() for x, w in zip(logprobs, weights))
        if entropy:
            total = total + 0.1 * sum((x * w).sum() for x, w in zip(entropies, weights))
        return total + (aux_loss if aux else 0)

    worst = assert_gradients_close(model, objective(tree.logprobs, tree.entropies, tree.aux_loss),
                                   objective(ref_logprobs, ref_entropies, ref_aux), grad_tol)
    if aux:
        torch.testing.assert_close(tree.aux_loss, ref_aux, rtol=value_tol, atol=value_tol)
    return tree, worst


@pytest.mark.parametrize("family", FAMILIES)
def test_matches_per_sequence_fp32(family):
    model = build(family)
    compare(model, chunk_edge_sequences(vocab=VOCAB), grad_tol=1e-4, aux=family in MOE_FAMILIES)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5", "kimi_linear_dense", "bailing_hybrid_dense",
                                    "olmo_hybrid", "nemotron_h_dense", "bamba", "falcon_h1", "falcon_h1_no_norm",
                                    "llama"])
def test_matches_per_sequence_fp64(family):
    """Mamba-2 hybrids: the reference's chunked scan in fp64 too (harts_hf.reference); Granite's hybrid has routed
    experts in every layer (transformers' grouped expert matmul has no fp64), so it is checked in fp32 only."""
    model = build(family, dtype=torch.float64, mild_decay=False)  # transformers' own init, decays up to 16
    compare(model, chunk_edge_sequences(vocab=VOCAB), grad_tol=1e-5, value_tol=1e-7, float64_recurrence=True)


@pytest.mark.parametrize("executed", [False, True], ids=["packed", "executed_layout"])
@pytest.mark.parametrize("family", ["qwen3_next_moe", "qwen3_5", "kimi_linear", "bailing_hybrid"])
def test_gradient_checkpointing_recomputes_the_same_plan(family, executed, monkeypatch):
    """Also with the mixers whole in their node's executed layout (``gated_deltanet.EXECUTED_LAYOUT``)."""
    import harts_hf.model_patches.gated_deltanet as gated_deltanet

    monkeypatch.setattr(gated_deltanet, "EXECUTED_LAYOUT", executed)
    calls = []
    original = gated_deltanet.tree_gdn_forward

    def counting(module, hidden_states, tree, project, layout):
        calls.append(id(tree))
        return original(module, hidden_states, tree, project, layout)

    monkeypatch.setattr(gated_deltanet, "tree_gdn_forward", counting)
    model = build(family)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    compare(model, random_tree_sequences(random.Random(3), 12, vocab=VOCAB, max_tail=140), grad_tol=1e-4,
            temperature=0.7, aux=family in MOE_FAMILIES)
    # two linear-attention layers, each run in the forward and again in the backward, with the same metadata
    assert len(calls) == 4 and len(set(calls)) == 1


@pytest.mark.parametrize("seed", range(3))
def test_random_forests(seed):
    model = build("qwen3_next", seed=seed)
    compare(model, random_tree_sequences(random.Random(seed), 10, vocab=VOCAB, max_tail=100), grad_tol=1e-4)


def test_revert_restores_bit_identical_behaviour():
    model = build("qwen3_next_moe")
    ids = torch.randint(0, VOCAB, (2, 37), generator=torch.Generator().manual_seed(0))
    with torch_reference_kernels():  # the unpatched model's CPU forward (transformers binds Triton where it imports)
        before = model(ids).logits
    state_before = {id(m): dict(vars(m)) for m in model.modules()}
    handle = apply_tree_patches(model)
    assert len(handle.linear_modules) == 2 and len(handle.attention_modules) == 2
    assert torch.equal(model(ids).logits, before), "patched model must be unchanged without tree metadata"
    tree_logprobs(model, [[1, 2, 3], [1, 2, 4]])
    handle.revert()
    with torch_reference_kernels():
        assert torch.equal(model(ids).logits, before)
    for module in model.modules():
        assert set(vars(module)) == set(state_before[id(module)]), type(module).__name__
    with apply_tree_patches(model) as handle:
        assert handle.active
    assert not handle.active and "forward" not in vars(handle.linear_modules[0])


def test_deep_copy_of_a_patched_model_runs_its_own_weights():
    import copy

    model = build("qwen3_next")
    apply_tree_patches(model)
    clone = copy.deepcopy(model).double()
    sequences = [[1, 2, 3, 4], [1, 2, 5]]
    out = tree_logprobs(clone, sequences)
    assert out.logprobs[0].dtype == torch.float32 or out.logprobs[0].dtype == torch.float64
    reference, _, _ = per_sequence_logprobs(clone, sequences)
    for a, b in zip(out.logprobs, reference):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-6, atol=1e-6)


def test_attention_by_runs_in_the_model():
    """The per-run attention path (used off CUDA for large forests) inside a real model."""
    model = build("qwen3_next")
    sequences = random_tree_sequences(random.Random(5), 8, vocab=VOCAB, max_tail=100)
    dense = tree_logprobs(model, sequences, attention_backend="sdpa")
    runs = tree_logprobs(model, sequences, attention_backend="runs")
    for a, b in zip(runs.logprobs, dense.logprobs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_attention_inputs_follow_autocast(monkeypatch):
    """HF Trainer's bf16=True keeps fp32 weights under autocast; RoPE's fp32 cos/sin then leave q and k in fp32.
    The tree attention must still get half-precision inputs (on CUDA that selects the varlen flash path; fp32
    would fall back to SDPA per run), exactly as SDPA under autocast would compute them."""
    import harts_hf.model_patches.core as core

    seen = []
    original = core.tree_attention

    def spy(q, k, v, *args, **kwargs):
        seen.append((q.dtype, k.dtype, v.dtype))
        return original(q, k, v, *args, **kwargs)

    monkeypatch.setattr(core, "tree_attention", spy)
    model = build("qwen3_next")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        tree_logprobs(model, chunk_edge_sequences(vocab=VOCAB))
    assert seen and set(seen) == {(torch.bfloat16,) * 3}


# how users run half precision: autocast over fp32 weights (HF Trainer's and TRL's bf16=True / fp16=True), or the
# weights themselves in bf16
PRECISIONS = {
    "bf16_autocast": (torch.float32, torch.bfloat16),
    "fp16_autocast": (torch.float32, torch.float16),
    "bf16_weights": (torch.bfloat16, None),
}


def half_precision_errors(logprobs, grads, reference, reference_grads) -> tuple[float, torch.Tensor]:
    """The mean absolute log-prob error against ``reference`` and the relative error of every parameter gradient
    against ``reference_grads`` (those with a nonzero gradient in both)."""
    value = torch.cat([(x.float() - r).abs() for x, r in zip(logprobs, reference)]).mean().item()
    relative = torch.tensor([((a.float() - b).norm() / b.norm()).item() for a, b in zip(grads, reference_grads)
                             if a is not None and b is not None and b.norm() > 0])
    return value, relative


@pytest.mark.parametrize("precision", sorted(PRECISIONS))
@pytest.mark.parametrize("family", FAMILIES)
def test_half_precision_error_is_the_per_sequence_paths(family, precision):
    """In half precision (here on the CPU) the tree's forward and backward run for every family, and its error
    against the fp32 run is the one-sequence-at-a-time path's in the same precision: the mean log-prob error and the
    median parameter-gradient error (relative, over parameters) within 1.5x of that path's (measured under bf16
    autocast: 0.85-1.06x and 0.80-1.09x; fp16 autocast and bf16 weights: 0.84-1.08x for log-probs)."""
    weights_dtype, autocast_dtype = PRECISIONS[precision]
    model = build(family)
    sequences = chunk_edge_sequences(vocab=VOCAB, base_len=150)
    generator = torch.Generator().manual_seed(0)
    reference, _, _ = per_sequence_logprobs(model, sequences)
    weights = [torch.randn(r.shape, generator=generator) for r in reference]

    def gradients(logprobs):
        params = [p for p in model.parameters() if p.requires_grad]
        return torch.autograd.grad(sum((x.float() * w).sum() for x, w in zip(logprobs, weights)), params,
                                   allow_unused=True)

    exact = gradients(reference)
    model.to(weights_dtype)
    with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        tree = tree_logprobs(model, sequences).logprobs
        path, _, _ = per_sequence_logprobs(model, sequences)

    def errors(logprobs):
        value, grads = half_precision_errors(logprobs, gradients(logprobs), reference, exact)
        assert torch.isfinite(grads).all()
        return value, grads.median().item()

    (tree_value, tree_grad), (path_value, path_grad) = errors(tree), errors(path)
    assert tree_value <= 1.5 * path_value, (tree_value, path_value)
    assert tree_grad <= 1.5 * path_grad, (tree_grad, path_grad)


@pytest.mark.parametrize("family", ["nemotron_h", "falcon_h1"])
def test_mamba2_scan_inputs_in_half_precision(family, monkeypatch):
    """``mamba2.SCAN_INPUTS``: an fp32 model without autocast computes the same under every setting, bit for bit;
    under bf16 autocast, and with bf16 weights, ``"half"`` hands the scan ``C``, ``B`` and ``dt x`` in bf16
    (``"fp32"``, and ``"cuda"`` on a CPU, in fp32; the decay in fp32 always), and under autocast the tree's error
    against the fp32 run is then that of each sequence run alone through the same patches (one-sequence forests: the
    per-trajectory path with the same kernels), within 1.5x (measured on the four Mamba-2 families: the same errors
    as with fp32 inputs to three digits, since C, B and x leave the projection and convolution in bf16 already)."""
    from harts_hf.model_patches import mamba2

    seen = []
    original = mamba2.tree_recurrence_with_handoffs

    def spy(tree, layer, inputs, *args, **kwargs):
        seen.append(tuple(x.dtype for x in inputs[:4]))
        return original(tree, layer, inputs, *args, **kwargs)

    monkeypatch.setattr(mamba2, "tree_recurrence_with_handoffs", spy)
    model = build(family)
    sequences = chunk_edge_sequences(vocab=VOCAB, base_len=150)
    weights = [torch.randn(len(s) - 1, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(sequences)]
    params = [p for p in model.parameters() if p.requires_grad]

    def run(setting, autocast, one_by_one=False):
        monkeypatch.setattr(mamba2, "SCAN_INPUTS", setting)
        seen.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            if one_by_one:
                logprobs = [tree_logprobs(model, [s]).logprobs[0] for s in sequences]
            else:
                logprobs = tree_logprobs(model, sequences).logprobs
        grads = torch.autograd.grad(sum((x.float() * w).sum() for x, w in zip(logprobs, weights)), params,
                                    allow_unused=True)
        return [x.detach().float() for x in logprobs], grads, set(seen)

    exact, exact_grads, dtypes = run("fp32", False)
    assert dtypes == {(torch.float32,) * 4}
    same, same_grads, dtypes = run("half", False)
    assert dtypes == {(torch.float32,) * 4}
    assert all(torch.equal(a, b) for a, b in zip(same, exact))
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(same_grads, exact_grads))
    for setting in ("fp32", "cuda"):
        assert run(setting, True)[2] == {(torch.float32,) * 4}, setting
    tree, tree_grads, dtypes = run("half", True)
    assert dtypes == {(torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.float32)}
    path, path_grads, _ = run("half", True, one_by_one=True)

    def errors(logprobs, grads):
        value, relative = half_precision_errors(logprobs, grads, exact, exact_grads)
        return value, relative.median().item()

    (tree_value, tree_grad), (path_value, path_grad) = errors(tree, tree_grads), errors(path, path_grads)
    assert 0 < tree_value <= 1.5 * path_value, (tree_value, path_value)
    assert tree_grad <= 1.5 * path_grad, (tree_grad, path_grad)
    model.to(torch.bfloat16)
    assert run("half", False)[2] == {(torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.float32)}
    assert run("fp32", False)[2] == {(torch.float32,) * 4}
    monkeypatch.setattr(mamba2, "SCAN_INPUTS", "bf16")
    with pytest.raises(ValueError, match="SCAN_INPUTS must be one of"):
        tree_logprobs(model, sequences[:1])


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_norms_in_row_blocks_change_nothing(family, monkeypatch):
    """fla's norm kernels autotune per 65,536-row bucket, so the patched layer applies the gated norm in blocks of
    at most that many rows; with a tiny block size forced, log-probs and gradients are still per-sequence exact."""
    from harts_hf.kernels import _backend

    monkeypatch.setattr(_backend, "FLA_ROW_BUCKET", 7)
    compare(build(family), chunk_edge_sequences(vocab=VOCAB), grad_tol=1e-4)


def test_l2norm_in_row_blocks_keeps_fla_shapes():
    """The fla node's L2-norm plumbing (blocks of rows, [T, H, D] <-> rows) with PyTorch stand-ins that follow
    fla's ``l2norm_fwd(x2d) -> (y, rstd)`` and ``l2norm_bwd(y, rstd, dy) -> dx`` contract."""
    from harts_hf.kernels import _backend
    from harts_hf.kernels.tree_gated_delta_rule.fla_backend import _l2norm, _l2norm_grad

    def fwd(x):
        assert x.ndim == 2
        rstd = torch.rsqrt(x.square().sum(-1) + 1e-6)
        return x * rstd[:, None], rstd

    def bwd(y, rstd, dy):
        assert y.ndim == 2 and rstd.ndim == 1
        return (dy - y * (dy * y).sum(-1, keepdim=True)) * rstd[:, None]

    x = torch.randn(13, 3, 8, dtype=torch.float64, requires_grad=True)
    dy = torch.randn_like(x)
    expected = torch.nn.functional.normalize(x, dim=-1, eps=0)
    (expected_grad,) = torch.autograd.grad(expected, x, dy)
    for rows in (1000, 5):
        _backend.FLA_ROW_BUCKET, previous = rows, _backend.FLA_ROW_BUCKET
        try:
            y, rstd = _l2norm(fwd, x.detach())
            grad = _l2norm_grad(bwd, y, rstd, dy)
        finally:
            _backend.FLA_ROW_BUCKET = previous
        assert y.shape == x.shape and rstd.shape == x.shape[:-1]
        torch.testing.assert_close(y, expected.detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(grad, expected_grad, rtol=1e-6, atol=1e-6)


def test_row_blocks_backward_is_one_concatenation():
    """The blocks' gradients are joined once (split's backward), not one zero-filled full-size tensor per block
    summed over blocks (a slice's backward): that summation cost ~1.3 s per step on full-size tau."""
    from harts_hf.kernels._backend import in_row_blocks

    x = torch.randn(64, 4, requires_grad=True)
    gate = torch.randn(64, 4, requires_grad=True)
    out = in_row_blocks(lambda a, b: a * torch.sigmoid(b), x, gate, rows=4)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out.square().sum().backward()
    names = [event.name for event in prof.events()]
    assert "aten::slice_backward" not in names
    torch.testing.assert_close(x.grad, (2 * out * torch.sigmoid(gate)).detach())


def test_top1_flags_are_the_per_sequence_argmax():
    """compute_top1: whether each token is its predicted distribution's argmax. Sequences continued greedily by the
    model itself (every generated token is an argmax) fork off one shared prompt, so both values occur."""
    model = build("qwen3_next")
    prompt = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    sequences = []
    with torch.no_grad(), torch_reference_kernels():
        for k in range(3):
            ids = torch.cat([prompt, torch.tensor([[k]])], dim=1)
            for _ in range(6):
                ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
            sequences.append(ids[0].tolist())
        expected = [model(torch.tensor([s])).logits[0, :-1].argmax(-1) == torch.tensor(s[1:]) for s in sequences]
    out = tree_logprobs(model, sequences, compute_top1=True)
    for got, want in zip(out.is_top1, expected):
        assert torch.equal(got, want)
    flags = torch.cat(expected)
    assert flags[-6:].all() and not flags.all()


RECURRENT_FAMILIES = ["qwen3_next", "qwen3_5", "kimi_linear_dense", "bailing_hybrid_dense", "olmo_hybrid",
                      "nemotron_h_dense", "bamba", "falcon_h1", "falcon_h1_no_norm"]


@pytest.mark.parametrize("family", RECURRENT_FAMILIES)
def test_mixers_in_the_executed_layout_match_per_sequence_fp64(family, monkeypatch):
    """``gated_deltanet.EXECUTED_LAYOUT``: every recurrent mixer run whole on its node's executed rows (hidden
    states gathered in, outputs gathered out; the conv's ancestors before each unit read from their own rows)."""
    import harts_hf.model_patches.gated_deltanet as gated_deltanet

    monkeypatch.setattr(gated_deltanet, "EXECUTED_LAYOUT", True)
    layouts = []
    original = gated_deltanet.executed_rows
    monkeypatch.setattr(gated_deltanet, "executed_rows", lambda plan: layouts.append(original(plan)) or layouts[-1])
    model = build(family, dtype=torch.float64, mild_decay=False)
    compare(model, chunk_edge_sequences(vocab=VOCAB), grad_tol=1e-5, value_tol=1e-7, float64_recurrence=True)
    assert layouts and not any(rows.identity for rows in layouts)  # replayed rows: not the packed layout again


@pytest.mark.parametrize("family,chunk", [("nemotron_h_dense", None), ("nemotron_h_dense", 32), ("bamba", 64),
                                          ("falcon_h1", 32), ("falcon_h1_no_norm", None)])
def test_mamba2_scan_on_another_chunk_grid_matches_per_sequence_fp64(family, chunk, monkeypatch):
    """``mamba2.CHUNK_SIZE``: the scan's chunk grid on forests, the default 64, 32, or the mixer's own ``chunk_size``
    (None: 16 in the tiny models; the reference always runs that): the same log-probs, entropies and gradients, with
    forks at and around the grid's edges (replays of up to ``chunk - 1`` rows)."""
    import harts_hf.model_patches.mamba2 as mamba2
    from harts_hf.kernels import TreeMetadata

    monkeypatch.setattr(mamba2, "CHUNK_SIZE", chunk)
    grids = []
    original = TreeMetadata.gdn_plan
    monkeypatch.setattr(TreeMetadata, "gdn_plan", lambda self, backend, chunk_size=None:
                        grids.append(chunk_size) or original(self, backend, chunk_size=chunk_size))
    model = build(family, dtype=torch.float64, mild_decay=False)
    assert {m.chunk_size for m in model.modules() if hasattr(m, "chunk_size")} == {16}
    compare(model, chunk_edge_sequences(vocab=VOCAB), grad_tol=1e-5, value_tol=1e-7, float64_recurrence=True)
    assert set(grids) - {None} == {chunk or 16}  # every Mamba-2 plan on that grid (None: the metadata's own, 64)


@pytest.mark.parametrize("value", [8, 48, 0, True, "64"])
def test_mamba2_chunk_size_refuses_a_grid_the_kernels_cannot_tile(value, monkeypatch):
    import harts_hf.model_patches.mamba2 as mamba2

    monkeypatch.setattr(mamba2, "CHUNK_SIZE", value)
    with pytest.raises(ValueError, match="mamba2.CHUNK_SIZE must be None or a power of two of at least 16"):
        tree_logprobs(build("nemotron_h"), [[1, 2, 3], [1, 2, 4]])
