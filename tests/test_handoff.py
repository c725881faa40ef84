"""Planner hand-offs executed: every piece its own forward + backward, the same log-probs and parameter gradients
as one tree forward (harts_hf.tree_logprobs) and as per-trajectory execution, every unique token computed with
gradient exactly once. CPU, tiny models.

Tolerances: fp32 log-probs 1e-5; fp32 gradients 1e-4 in relative norm against the per-trajectory reference
(as test_tree_logprobs: A_log / dt_bias gradients carry ~1e-5 of the reference's own rounding) and 3e-5 against the
tree forward; fp64 models 1e-6 (the LM head runs in fp32 either way).
"""

import random

import pytest
import torch

from harts_hf import tree_logprobs
from harts_hf.kernels import (
    TreeContext,
    TreeMetadata,
    build_gated_delta_plan,
    build_varlen_layout,
    tree_attention,
    tree_attention_mask,
    tree_causal_conv1d,
    tree_gated_delta_rule,
)
from harts_hf.model_patches import chunk_grid
from harts_hf.planner import execute_plan, plan
from harts_hf.reference import per_sequence_logprobs
from harts_hf.trees import PrefixForest
from harts_hf.workloads import make_workload
from tests.forests import chunk_edge_sequences, random_tree_sequences
from tests.models import VOCAB, build

WORST: dict = {}  # largest relative error per comparison over the file (inspect with a debugger or -s prints)


def handoff_sequences(seed: int = 0):
    """Forks chosen so that budget 140 cuts at every hand-off case: chunk-boundary state from inside the source
    plus replay (fork at 140: c = 128), no replay (fork at 128), zero state (fork at 20), a chain whose middle
    piece passes its own incoming state on (fork at 141: c = 128 again, replay rows from the context) or hands
    on a state of its own run (fork at 210: c = 192)."""
    rng = random.Random(seed)

    def tail(n):
        return [rng.randrange(VOCAB) for _ in range(n)]

    base = tail(150)
    fork = base[:140] + tail(100)
    return [base, fork, base[:140] + tail(100), fork[:141] + tail(60), fork[:210] + tail(50), base[:128] + tail(90),
            base[:20] + tail(70), tail(30)]


def max_relative(a_list, b_list) -> float:
    worst = 0.0
    for a, b in zip(a_list, b_list):
        if b.numel():
            worst = max(worst, ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item())
    return worst


def grads_of(model):
    return {name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}


def compare_grads(got: dict, expected: dict, tol: float, what: str) -> float:
    worst = 0.0
    for name, b in expected.items():
        a = got[name]
        if b is None or b.norm() == 0:
            assert a is None or a.abs().max() == 0, f"{what}: {name} has a gradient the reference does not"
            continue
        assert a is not None, f"{what}: {name} got no gradient"
        error = ((a - b).norm() / b.norm()).item()
        worst = max(worst, error)
        assert error <= tol, f"{what}: {name}: relative gradient error {error:.2e} > {tol:.0e}"
    return worst


def weights_for(sequences, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(len(s) - 1, generator=generator, dtype=dtype) for s in sequences]


def tree_objective(model, sequences, weights, entropy_weights):
    out = tree_logprobs(model, sequences, compute_entropy=True)
    loss = sum((x * w).sum() for x, w in zip(out.logprobs, weights))
    loss = loss + sum((x * w).sum() for x, w in zip(out.entropies, entropy_weights))
    model.zero_grad()
    loss.backward()
    return out, grads_of(model)


def count_grad_tokens(model):
    """Tokens through the embedding while gradients are on (one per computed token and forward)."""
    counted = []
    hook = model.get_input_embeddings().register_forward_hook(
        lambda module, inputs, output: counted.append(inputs[0].numel()) if torch.is_grad_enabled() else None)
    return counted, hook


def check_plan(model, sequences, budget, *, reference: bool, dtype=torch.float32, recompute=True, chunk_size=64):
    the_plan = plan(sequences, token_budget=budget, chunk_size=chunk_size)
    assert any(p.handoff is not None for p in the_plan.pieces), "the budget must force hand-offs"
    weights, entropy_weights = weights_for(sequences, dtype), weights_for(sequences, dtype, seed=1)
    model.zero_grad()
    counted, hook = count_grad_tokens(model)
    try:
        run = execute_plan(model, the_plan, logprob_weights=weights, entropy_weights=entropy_weights,
                           recompute=recompute)
    finally:
        hook.remove()
    executed = grads_of(model)
    unique = the_plan.packed.num_tokens
    assert sum(counted) == unique == run.stats["grad_tokens"], "every unique token once with gradient"
    if recompute:  # the hand-off forwards run only the segments on the root paths of the branch tokens
        assert run.stats["nograd_tokens"] == handoff_tokens(the_plan)[0]
    assert run.stats["grad_forwards"] == len(the_plan.pieces)
    assert run.memory == []  # the allocator trace is CUDA-only

    tree, tree_grads = tree_objective(model, sequences, weights, entropy_weights)
    value_tol, grad_tol = (1e-5, 3e-5) if dtype == torch.float32 else (1e-6, 1e-6)
    errors = {"logprobs vs tree": max_relative(run.logprobs, tree.logprobs),
              "entropies vs tree": max_relative(run.entropies, tree.entropies),
              "grads vs tree": compare_grads(executed, tree_grads, grad_tol, "plan vs tree")}
    assert errors["logprobs vs tree"] <= value_tol and errors["entropies vs tree"] <= value_tol, errors
    # the loss is the weighted sum of the run's own log-probs and entropies (checked against the tree's above),
    # summed here in float64; the weights are zero-mean, so the sum cancels and its rounding is judged at the scale
    # of the terms (against the tree's values it was 1.5e-5 relative to the small sum on an AMD EPYC CPU)
    terms = [x.detach().double() * w.double() for x, w in zip(run.logprobs + run.entropies, weights + entropy_weights)]
    torch.testing.assert_close(run.loss.double(), sum(t.sum() for t in terms), rtol=0,
                               atol=1e-6 * sum(t.abs().sum() for t in terms).item())
    if reference:
        ref_logprobs, ref_entropies, _ = per_sequence_logprobs(model, sequences, compute_entropy=True)
        loss = sum((x * w).sum() for x, w in zip(ref_logprobs, weights))
        loss = loss + sum((x * w).sum() for x, w in zip(ref_entropies, entropy_weights))
        model.zero_grad()
        loss.backward()
        errors["logprobs vs reference"] = max_relative(run.logprobs, ref_logprobs)
        errors["grads vs reference"] = compare_grads(executed, grads_of(model), 1e-4 if dtype == torch.float32 else
                                                     1e-6, "plan vs per-trajectory")
        assert errors["logprobs vs reference"] <= value_tol, errors
    model.zero_grad()
    for key, value in errors.items():
        WORST[key] = max(WORST.get(key, 0.0), value)
    return the_plan, run


def handoff_tokens(the_plan) -> tuple[int, int]:
    """Tokens the sources' hand-off forwards need (the whole segments of each source that hold a root-path token of
    one of its children's branch tokens, walked token by token), and all of those sources' tokens."""
    packed = the_plan.packed
    cu = packed.cu_seqlens.tolist()
    segment_of = {t: s for s in range(len(cu) - 1) for t in range(cu[s], cu[s + 1])}
    needed_total = source_total = 0
    for piece in the_plan.pieces:
        children = [p for p in the_plan.pieces if p.handoff is not None and p.handoff.source_piece == piece.index]
        if not children:
            continue
        needed = set()
        for child in children:
            token = child.handoff.branch_token
            while token >= 0:
                if segment_of[token] in piece.segments:
                    needed.add(segment_of[token])
                token = int(packed.parent[token])
        needed_total += sum(cu[s + 1] - cu[s] for s in needed)
        source_total += sum(cu[s + 1] - cu[s] for s in piece.segments)
    return needed_total, source_total


def longest_run(sequences) -> int:
    return int(PrefixForest.from_sequences(sequences).pack().cu_seqlens.diff().max())


# ---------------------------------------------------------------------------- model level
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5", "kimi_linear", "bailing_hybrid", "olmo_hybrid",
                                    "nemotron_h", "bamba", "falcon_h1", "llama"])
def test_forced_splits_match_tree_and_reference(family):
    model = build(family)
    sequences = handoff_sequences()
    the_plan, _ = check_plan(model, sequences, 140, reference=True)
    handoffs = [p.handoff for p in the_plan.pieces if p.handoff is not None]
    # the forest exercises every hand-off case (see handoff_sequences)
    assert {(h.ancestor_tokens, h.state_depth, h.replay_tokens) for h in handoffs} >= {
        (140, 128, 12), (128, 128, 0), (20, 0, 20), (141, 128, 13), (210, 192, 18)}
    chained = [p for p in the_plan.pieces if p.handoff and the_plan.pieces[p.handoff.source_piece].handoff]
    assert {p.handoff.ancestor_tokens for p in chained} >= {141, 210}
    needed, sources = handoff_tokens(the_plan)
    assert 0 < needed < sources  # some of the sources' segments are no child's ancestors: left out of the hand-offs


@pytest.mark.parametrize("family", ["qwen3_next", "kimi_linear", "nemotron_h"])
def test_forced_splits_with_the_mixers_in_the_executed_layout(family, monkeypatch):
    """``gated_deltanet.EXECUTED_LAYOUT``: pieces that only hand off (and the whole tree) run their mixers in the
    executed layout and export their children's rows from it; pieces below a branch point keep the packed layout.
    The same log-probs, entropies and gradients as the tree and the per-trajectory path."""
    from harts_hf.model_patches import gated_deltanet

    monkeypatch.setattr(gated_deltanet, "EXECUTED_LAYOUT", True)
    exported = []
    original = gated_deltanet._export_rows

    def spy(tree, layer, own, context, count, executed=None):
        exported.append(executed is not None)
        return original(tree, layer, own, context, count, executed)

    monkeypatch.setattr(gated_deltanet, "_export_rows", spy)
    check_plan(build(family), handoff_sequences(), 140, reference=True)
    assert any(exported) and not all(exported)  # exports from both layouts


@pytest.mark.parametrize("family", ["qwen3_next", "kimi_linear", "nemotron_h", "llama"])
def test_runs_longer_than_the_budget_are_cut_inside(family):
    """A budget below the longest runs without a branch point (handoff_sequences' runs of up to 108 tokens and a
    lone trajectory of 300, budget 100): the planner cuts them inside, at chunk boundaries, where the state hands
    over with nothing replayed. Log-probs, entropies and every gradient match one tree forward and the
    per-trajectory path."""
    rng = random.Random(2)
    sequences = handoff_sequences() + [[rng.randrange(VOCAB) for _ in range(300)]]
    the_plan, _ = check_plan(build(family), sequences, 100, reference=True)
    assert max(piece.unique_tokens for piece in the_plan.pieces) <= 100
    assert the_plan.packed.num_segments > PrefixForest.from_sequences(sequences).pack().num_segments
    inside = [p.handoff for p in the_plan.pieces if p.handoff is not None and p.handoff.replay_tokens == 0
              and p.handoff.state_depth > 0 and p.handoff.state_depth % 64 == 0]
    assert {h.state_depth for h in inside} >= {64, 128, 192, 256}  # the lone trajectory's cuts among them


def test_inside_cuts_follow_the_models_chunk_grid(monkeypatch):
    """A Mamba-2 model with chunks of 128: ``chunk_grid`` gives 128, and the planner cuts the long runs at multiples
    of 128 only, where every layer's state hands over with nothing replayed (on the default grid of 64, odd multiples
    of 64 replay 64 rows in the Mamba layers). Exact against one tree forward and the per-trajectory path. With the
    mixers' own chunks (``mamba2.CHUNK_SIZE = None``; the default, 64, is the next test's subject)."""
    import harts_hf.model_patches.mamba2 as mamba2

    monkeypatch.setattr(mamba2, "CHUNK_SIZE", None)
    model = build("nemotron_h")
    mixers = [m for m in model.modules() if type(m).__name__ == "NemotronHMamba2Mixer"]
    assert mixers and chunk_grid(model) == 64  # the test model's chunks of 16
    for mixer in mixers:
        mixer.chunk_size = 128
    assert chunk_grid(model) == 128
    rng = random.Random(3)
    sequences = handoff_sequences() + [[rng.randrange(VOCAB) for _ in range(400)]]
    the_plan, _ = check_plan(model, sequences, 150, reference=True, chunk_size=chunk_grid(model))
    inside = [p.handoff for p in the_plan.pieces if p.handoff is not None and p.handoff.replay_tokens == 0
              and p.handoff.state_depth > 0]
    assert {h.state_depth for h in inside} >= {128, 256}  # the lone trajectory: 0-128, 128-256, 256-400
    assert all(h.state_depth % 128 == 0 for h in inside)
    assert chunk_grid(build("qwen3_next")) == 64 and chunk_grid(build("llama")) == 64


def test_mamba2_chunk_size_sets_the_grid_the_planner_cuts_on(monkeypatch):
    """``mamba2.CHUNK_SIZE`` overrides the mixers' own chunks (16 in the test model) for the plan and the planner's
    grid alike: at 128 the long runs are cut at multiples of 128, each hand-off replays on that grid, and the pieces
    match one tree forward and the per-trajectory path (which keeps the mixers' own chunks)."""
    import harts_hf.model_patches.mamba2 as mamba2

    model = build("nemotron_h")
    monkeypatch.setattr(mamba2, "CHUNK_SIZE", 128)
    assert chunk_grid(model) == 128
    rng = random.Random(3)
    sequences = handoff_sequences() + [[rng.randrange(VOCAB) for _ in range(400)]]
    the_plan, _ = check_plan(model, sequences, 150, reference=True, chunk_size=chunk_grid(model))
    handoffs = [p.handoff for p in the_plan.pieces if p.handoff is not None]
    assert {h.state_depth for h in handoffs} >= {128, 256} and all(h.state_depth % 128 == 0 for h in handoffs)
    assert any(h.replay_tokens > 0 for h in handoffs)  # states handed over at 128 with rows replayed after them


@pytest.mark.parametrize("seed", range(3))
def test_random_forests(seed):
    rng = random.Random(seed)
    sequences = chunk_edge_sequences(vocab=VOCAB, seed=seed) if seed == 0 else \
        random_tree_sequences(rng, 12, vocab=VOCAB, max_tail=150)
    model = build(["qwen3_next", "qwen3_5", "qwen2"][seed], seed=seed)
    the_plan, _ = check_plan(model, sequences, longest_run(sequences), reference=seed == 0)
    assert len(the_plan.pieces) > 3


def test_recompute_off_and_fp64():
    sequences = random_tree_sequences(random.Random(4), 10, vocab=VOCAB, max_tail=140)
    model = build("qwen3_next", dtype=torch.float64)
    check_plan(model, sequences, longest_run(sequences), reference=False, dtype=torch.float64)
    _, run = check_plan(model, sequences, longest_run(sequences), reference=False, dtype=torch.float64,
                        recompute=False)
    assert run.stats["nograd_forwards"] == 0


def test_workload_batch():
    workload = make_workload("search", scale=0.005, seed=0)
    sequences = [[token % VOCAB for token in s] for s in workload.sequences]
    model = build("qwen3_5")
    the_plan, _ = check_plan(model, sequences, 2 * longest_run(sequences), reference=True)
    assert len(the_plan.pieces) >= 8


def test_per_piece_loss_function_matches_trl_layout():
    """A nonlinear per-token loss (clipped ratio times advantage, TRL style) indexed by (sequence, position)."""
    sequences = handoff_sequences(seed=1)
    model = build("qwen3_next")
    lengths = [len(s) - 1 for s in sequences]
    generator = torch.Generator().manual_seed(0)
    old = torch.randn(len(sequences), max(lengths), generator=generator) * 0.1 - 4.6
    advantages = torch.randn(len(sequences), generator=generator)
    mask = torch.zeros(len(sequences), max(lengths))
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    normaliser = mask.sum()

    def per_token(logprobs, sequence, position):
        ratio = (logprobs - old[sequence, position]).exp()
        advantage = advantages[sequence]
        return -torch.minimum(ratio * advantage, ratio.clamp(0.8, 1.2) * advantage) * mask[sequence, position]

    def loss_fn(scored):
        return per_token(scored.logprobs[scored.occurrence], scored.sequence, scored.position).sum() / normaliser

    model.zero_grad()
    run = execute_plan(model, plan(sequences, token_budget=140), loss_fn=loss_fn)
    executed = grads_of(model)
    tree = tree_logprobs(model, sequences)
    padded = torch.zeros(len(sequences), max(lengths))
    padded = torch.stack([torch.cat([x, padded[i, x.shape[0]:]]) for i, x in enumerate(tree.logprobs)])
    rows, columns = mask.nonzero(as_tuple=True)
    loss = per_token(padded[rows, columns], rows, columns).sum() / normaliser
    model.zero_grad()
    loss.backward()
    WORST["loss_fn grads vs tree"] = compare_grads(executed, grads_of(model), 3e-5, "loss_fn")
    torch.testing.assert_close(run.loss, loss.detach(), rtol=1e-5, atol=1e-6)


def test_forward_only_pass_and_gradient_checkpointing():
    sequences = handoff_sequences(seed=2)
    model = build("qwen3_5")
    the_plan = plan(sequences, token_budget=140)
    with torch.no_grad():
        expected = tree_logprobs(model, sequences).logprobs
    run = execute_plan(model, the_plan)  # no loss: each piece once, no gradients
    assert run.loss is None and run.stats["grad_forwards"] == 0
    assert run.stats["nograd_tokens"] == the_plan.packed.num_tokens
    assert all(p.grad is None for p in model.parameters())
    assert max_relative(run.logprobs, expected) <= 1e-5

    # checkpointed layers recompute in the backward with the same metadata; hand-offs keep the first export
    weights, entropy_weights = weights_for(sequences), weights_for(sequences, seed=1)
    _, tree_grads = tree_objective(model, sequences, weights, entropy_weights)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    model.zero_grad()
    execute_plan(model, the_plan, logprob_weights=weights, entropy_weights=entropy_weights)
    compare_grads(grads_of(model), tree_grads, 3e-5, "checkpointed plan vs tree")


def test_handoff_tensors_do_not_hold_whole_forward_tensors(monkeypatch):
    """What outlives a forward (the source's exports while its children run, each child's context gradients until
    the source's backward) owns its storage: not a view of a whole layer's tensor (a hidden row of the final hidden
    states; the context rows of ``cat([own, context])``'s gradient, which autograd hands to the leaf as a view).
    On the GPU such views kept ~3 GiB alive per child piece (benchmarks/plan_memory_probe.py)."""
    from harts_hf.planner import execute as execute_module

    def owns_storage(tensor):
        return tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()

    kept = []
    run_children = execute_module._PlanRunner._run_children

    def checked(self, children, exports):
        kept.extend(t for export in exports for t in export.tensors.values())
        gradients = run_children(self, children, exports)
        kept.extend(g for grads in gradients for g in grads.values() if g is not None)
        return gradients

    monkeypatch.setattr(execute_module._PlanRunner, "_run_children", checked)
    sequences = handoff_sequences(seed=3)
    model = build("qwen3_next")
    the_plan = plan(sequences, token_budget=140)
    execute_plan(model, the_plan, logprob_weights=weights_for(sequences))
    assert len(kept) > 20
    assert all(owns_storage(t) for t in kept), [tuple(t.shape) for t in kept if not owns_storage(t)][:5]


def test_custom_backward_and_deferred_last_backward():
    """The path DeepSpeed takes (tests/test_deepspeed.py runs it for real): every piece's backward through a
    ``backward(roots, gradients)`` callable on ``backward_surrogate`` except the last, which the caller runs from
    ``PlanExecution.deferred``; the parameter gradients equal the plain executor's."""
    from harts_hf.planner.execute import backward_surrogate

    sequences = handoff_sequences(seed=4)
    model = build("qwen3_next")
    the_plan = plan(sequences, token_budget=140)
    weights = weights_for(sequences)
    execute_plan(model, the_plan, logprob_weights=weights)
    expected = grads_of(model)
    model.zero_grad()
    calls = []

    def backward(roots, gradients):
        calls.append(len(roots))
        backward_surrogate(roots, gradients).backward()

    run = execute_plan(model, the_plan, logprob_weights=weights, backward=backward, defer_last_backward=True)
    roots, gradients = run.deferred
    assert len(calls) == run.stats["pieces"] - 1 and max(calls) > 1  # hand-off roots go through the callable too
    backward_surrogate(roots, gradients).backward()
    compare_grads(grads_of(model), expected, 1e-6, "custom + deferred backward vs plain")
    assert execute_plan(model, the_plan, logprob_weights=weights).deferred is None


def test_phased_schedule_pads_like_zero3_needs():
    """``schedule='phased'`` (DeepSpeed ZeRO-3 with planner pieces): every hand-off forward first, then every
    forward+backward with the last one deferred; the same gradients, log-probs and loss as the depth-first walk,
    and a process's sequence of passes is exactly "k no-grad forwards, between_phases, n (forward, backward)
    pairs", so fillers can pad it to the same counts on every process."""
    from harts_hf.planner.execute import backward_surrogate

    sequences = handoff_sequences(seed=4)
    model = build("qwen3_next")
    the_plan = plan(sequences, token_budget=110)
    children = {p.handoff.source_piece for p in the_plan.pieces if p.handoff is not None}
    nested = [p for p in the_plan.pieces if p.handoff is not None and p.index in children]
    assert nested, "the plan should have a piece that is both a child and a source"
    weights = weights_for(sequences)
    expected_run = execute_plan(model, the_plan, logprob_weights=weights)
    expected = grads_of(model)
    model.zero_grad()
    events = []
    hook = model.register_forward_pre_hook(lambda module, args: events.append("P" if torch.is_grad_enabled() else "F"))

    def backward(roots, gradients):
        events.append("B")
        backward_surrogate(roots, gradients).backward()

    try:
        run = execute_plan(model, the_plan, logprob_weights=weights, backward=backward, defer_last_backward=True,
                           schedule="phased", between_phases=lambda: events.append("|"))
    finally:
        hook.remove()
    backward_surrogate(*run.deferred).backward()
    n, k = len(the_plan.pieces), len(children)
    assert "".join(events) == "F" * k + "|" + "PB" * (n - 1) + "P"
    compare_grads(grads_of(model), expected, 1e-6, "phased vs depth-first")
    for got, want in zip(run.logprobs, expected_run.logprobs):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(run.loss, expected_run.loss, rtol=1e-6, atol=1e-6)
    assert run.stats["pieces"] == n and run.stats["nograd_forwards"] == k and run.stats["grad_forwards"] == n
    with pytest.raises(ValueError, match="recompute=True"):
        execute_plan(model, the_plan, logprob_weights=weights, schedule="phased", recompute=False)
    with pytest.raises(ValueError, match="schedule must be"):
        execute_plan(model, the_plan, logprob_weights=weights, schedule="breadth_first")


# ---------------------------------------------------------------------------- kernels with context
@pytest.mark.parametrize("per_channel_gates", [False, True])
def test_kernels_with_context_match_the_whole_forest(per_channel_gates):
    """Each piece's kernels, given context rows gathered from the whole forest's inputs, reproduce the whole
    forest's outputs on the piece's tokens (attention: sdpa and runs; conv; gated delta rule with replay and
    the requested hand-off states, with Gated DeltaNet's per-head and Kimi Delta Attention's per-channel gates)."""
    sequences = handoff_sequences(seed=3)
    the_plan = plan(sequences, token_budget=140)
    packed = the_plan.packed
    U, generator = packed.num_tokens, torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(U, heads, 8, generator=generator, dtype=torch.float64) for heads in (4, 2, 2))
    x, weight = torch.randn(U, 6, generator=generator, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    gq, gk = (torch.randn(U, 2, 8, generator=generator, dtype=torch.float64) for _ in range(2))
    gv = torch.randn(U, 4, 8, generator=generator, dtype=torch.float64)
    g = -torch.rand(U, 4, *((8,) if per_channel_gates else ()), generator=generator, dtype=torch.float64)
    beta = torch.rand(U, 4, generator=generator, dtype=torch.float64)
    attention = tree_attention(q, k, v, packed.subtree_end, backend="sdpa")
    conv = tree_causal_conv1d(x, weight, None, packed.ancestor_table(4), "silu")
    full_plan = build_gated_delta_plan(packed)
    delta = tree_gated_delta_rule(gq, gk, gv, g, beta, full_plan, use_qk_l2norm_in_kernel=True)
    cu = packed.cu_seqlens.tolist()
    for piece in the_plan.pieces:
        tokens = torch.cat([torch.arange(cu[s], cu[s + 1]) for s in piece.segments])
        sub = packed.select(piece.segments)
        assert torch.equal(sub.input_ids, packed.input_ids[tokens])
        d0 = int(packed.position_ids[tokens[0]])
        ancestors = _root_path(packed, int(tokens[0]))  # [d0] packed ids, oldest first
        for backend in ("sdpa", "runs"):
            layout = build_varlen_layout(sub, d0) if backend == "runs" else None
            out = tree_attention(q[tokens], k[tokens], v[tokens], sub.subtree_end, backend=backend, layout=layout,
                                 context_k=k[ancestors], context_v=v[ancestors])
            torch.testing.assert_close(out, attention[tokens], rtol=1e-10, atol=1e-10)
        rows = min(3, d0)
        out = tree_causal_conv1d(x[tokens], weight, None, sub.ancestor_table(4, rows), "silu",
                                 context=x[ancestors[d0 - rows:]])
        torch.testing.assert_close(out, conv[tokens], rtol=1e-10, atol=1e-10)
        boundary = 64 * (d0 // 64)
        replay = ancestors[boundary:]
        state = _state_at(gq, gk, gv, g, beta, ancestors[:boundary]) if boundary else None
        children = [p for p in the_plan.pieces if p.handoff is not None and p.handoff.source_piece == piece.index]
        branches = [int(torch.searchsorted(tokens, child.handoff.branch_token)) for child in children]
        for final_states_only in (False, True):  # the plan kinds of the torch and the fla backend
            sub_plan = build_gated_delta_plan(sub, final_states_only=final_states_only, state_requests=branches)
            assert sub_plan.context_tokens == d0 - boundary
            out, states = tree_gated_delta_rule(
                gq[tokens], gk[tokens], gv[tokens], g[tokens], beta[tokens], sub_plan, use_qk_l2norm_in_kernel=True,
                initial_state=state, output_requested_states=True,
                context=tuple(t[replay] for t in (gq, gk, gv, g, beta)) if d0 > boundary else None)
            torch.testing.assert_close(out, delta[tokens], rtol=1e-9, atol=1e-9)
            for child, handed in zip(children, states):  # the hand-off state: the child's path up to its boundary
                child_boundary = child.handoff.state_depth
                path = _root_path(packed, packed.cu_seqlens[child.segments[0]].item())[:child_boundary]
                if child_boundary == 0:
                    assert handed is None
                else:
                    torch.testing.assert_close(handed, _state_at(gq, gk, gv, g, beta, path), rtol=1e-9, atol=1e-9)


def _root_path(packed, token: int) -> torch.Tensor:
    path, current = [], int(packed.parent[token])
    while current >= 0:
        path.append(current)
        current = int(packed.parent[current])
    return torch.tensor(path[::-1], dtype=torch.long)


def _state_at(q, k, v, g, beta, path):
    """The state after the tokens of ``path`` from zeros (one chain, run as a forest of one sequence)."""
    chain = PrefixForest.from_sequences([list(range(path.shape[0]))]).pack()
    chain_plan = build_gated_delta_plan(chain, state_requests=[path.shape[0] - 1])
    _, states = tree_gated_delta_rule(*(t[path] for t in (q, k, v, g, beta)), chain_plan,
                                      use_qk_l2norm_in_kernel=True, output_requested_states=True)
    return states[0]


# ---------------------------------------------------------------------------- bad input
def test_bad_input():
    sequences = handoff_sequences()
    model = build("llama")
    the_plan = plan(sequences, token_budget=140)
    with pytest.raises(ValueError, match=r"logprob_weights\[0\] has shape \(3,\)"):
        execute_plan(model, the_plan, logprob_weights=[torch.zeros(3)] * len(sequences))
    with pytest.raises(ValueError, match="one per sequence"):
        execute_plan(model, the_plan, logprob_weights=weights_for(sequences)[:2])
    with pytest.raises(ValueError, match="not both"):
        execute_plan(model, the_plan, logprob_weights=weights_for(sequences), loss_fn=lambda scored: 0)
    with pytest.raises(ValueError, match="scalar tensor"):
        execute_plan(model, the_plan, loss_fn=lambda scored: scored.logprobs)
    with pytest.raises(TypeError, match="Plan returned by"):
        execute_plan(model, sequences, logprob_weights=weights_for(sequences))
    spread = plan(sequences, token_budget=140, num_replicas=3, cross_replica=True)
    assert spread.cross_replica_handoffs() > 0
    with pytest.raises(ValueError, match="needs torch.distributed"):  # without a process group
        for replica in range(3):
            execute_plan(model, spread, logprob_weights=weights_for(sequences), replica=replica)
    checkpointed = build("llama")
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(ValueError, match="'use_reentrant': False"):
        execute_plan(checkpointed, the_plan, logprob_weights=weights_for(sequences))
    # a piece cut out below a branch point cannot run without its hand-off
    piece = next(p for p in the_plan.pieces if p.handoff is not None and p.handoff.state_depth > 0)
    sub = the_plan.packed.select(piece.segments)
    with pytest.raises(ValueError, match="pass context=export.as_context"):
        TreeMetadata(sub)
    with pytest.raises(ValueError, match="needs a forest whose roots all sit at that depth"):
        TreeMetadata(sub, context=TreeContext(piece.handoff.ancestor_tokens + 1))
    with pytest.raises(ValueError, match="pass initial_state"):
        sub_plan = build_gated_delta_plan(sub)
        rows = sub_plan.context_tokens
        inputs = [torch.zeros(sub.num_tokens + rows, *shape) for shape in ((2, 8), (2, 8), (4, 8), (4,), (4,))]
        tree_gated_delta_rule(*(t[:sub.num_tokens] for t in inputs), sub_plan,
                              context=tuple(t[sub.num_tokens:] for t in inputs) if rows else None)
    with pytest.raises(ValueError, match="context_tokens"):
        tree_attention(*(torch.zeros(sub.num_tokens, 2, 8) for _ in range(3)), sub.subtree_end,
                       mask=tree_attention_mask(sub.subtree_end), context_k=torch.zeros(5, 2, 8),
                       context_v=torch.zeros(5, 2, 8))


def test_no_sync_wraps_every_backward_but_the_last():
    """DDP's model.no_sync around each forward with gradient and its backward except the last pair: gradients
    all-reduce once per call. Seen here as the grad-enabled state of every forward inside / outside the context."""
    from contextlib import contextmanager

    sequences = handoff_sequences()
    model = build("qwen3_next")
    the_plan = plan(sequences, token_budget=140)
    inside, forwards = [], []

    @contextmanager
    def no_sync():
        inside.append(True)
        yield
        inside.pop()

    model.register_forward_hook(lambda module, args, output: forwards.append((torch.is_grad_enabled(), bool(inside))))
    run = execute_plan(model, the_plan, logprob_weights=weights_for(sequences), no_sync=no_sync)
    with_gradient = [synced for grad, synced in forwards if grad]
    assert len(with_gradient) == run.stats["grad_forwards"] == len(the_plan.pieces) > 2
    assert with_gradient == [True] * (len(with_gradient) - 1) + [False]  # only the last forward+backward syncs
    with pytest.raises(ValueError, match="recompute=True"):
        execute_plan(model, the_plan, logprob_weights=weights_for(sequences), no_sync=no_sync, recompute=False)


def test_synchronised_backward_reaches_every_parameter():
    """A 1-token root whose children are all cut off predicts nothing itself, yet the last (synchronised) backward
    must reach every trainable parameter, or DDP's reducer waits for the LM head forever."""
    from contextlib import contextmanager

    rng = random.Random(0)
    sequences = [[1] + [rng.randrange(VOCAB) for _ in range(60)] for _ in range(3)]
    the_plan = plan(sequences, token_budget=60)  # root + any child = 61 tokens: every child is cut off
    root = next(p for p in the_plan.pieces if p.handoff is None)
    assert root.unique_tokens == 1 and len(the_plan.pieces) == 4
    model = build("qwen3_next")
    inside, synced = [], set()

    @contextmanager
    def no_sync():
        inside.append(True)
        yield
        inside.pop()

    for name, parameter in model.named_parameters():
        parameter.register_hook(lambda grad, name=name: None if inside else synced.add(name))
    run = execute_plan(model, the_plan, logprob_weights=weights_for(sequences), no_sync=no_sync)
    assert synced == {name for name, p in model.named_parameters() if p.requires_grad}
    reference = build("qwen3_next")
    out = tree_logprobs(reference, sequences=sequences)
    sum((lp * w).sum() for lp, w in zip(out.logprobs, weights_for(sequences))).backward()
    for (name, a), (_, b) in zip(model.named_parameters(), reference.named_parameters()):
        assert ((a.grad - b.grad).norm() / b.grad.norm()).item() < 3e-5, name
    assert run.stats["grad_tokens"] == the_plan.packed.num_tokens


@pytest.mark.parametrize("replicas, recompute, port", [(2, "recompute", 29541), (3, "keep", 29542)])
def test_handoffs_across_replicas(tmp_path, replicas, recompute, port):
    """Pieces of one tree on different processes (torchrun, gloo): sources send their children's contexts and
    receive the gradients back. Summed over ranks, the parameter gradients equal one process running every piece;
    each token's log-prob and entropy comes from the rank that owns its piece."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent / "scripts" / "cross_replica_plan.py"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(replicas),
                             "--master_port", str(port), str(script), str(tmp_path), str(replicas), recompute],
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(replicas)]
    assert ranks[0]["crossing"] > 0 and all(r["pieces"] for r in ranks), "every rank must own pieces"

    model = build("qwen3_next")
    sequences = handoff_sequences(seed=3)
    the_plan = plan(sequences, token_budget=140, num_replicas=replicas, cross_replica=True)
    run = execute_plan(model, the_plan, logprob_weights=weights_for(sequences),
                       entropy_weights=weights_for(sequences, seed=1))
    expected = grads_of(model)
    summed = {name: None if all(r["grads"][name] is None for r in ranks) else
              sum(r["grads"][name] for r in ranks if r["grads"][name] is not None) for name in expected}
    compare_grads(summed, expected, 1e-5, f"{replicas} replicas vs one process")
    for key in ("token_logprobs", "token_entropies"):
        torch.testing.assert_close(sum(r[key] for r in ranks), getattr(run, key), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sum(r["loss"] for r in ranks), run.loss, rtol=1e-5, atol=1e-5)
    assert sum(r["stats"]["grad_tokens"] for r in ranks) == the_plan.packed.num_tokens  # every token once


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5", "kimi_linear", "bailing_hybrid", "nemotron_h"])
def test_sibling_pieces_below_one_branch_token(family):
    """A GRPO-like batch (one prompt, 20 completions) cut at budget 300: the completions below the prompt's last
    token share pieces (several roots, one context: replayed GDN rows and conv window per root, attention context
    for every query). Log-probs, entropies and every gradient match one tree forward and the per-trajectory path."""
    rng = random.Random(0)
    prompt = [rng.randrange(VOCAB) for _ in range(100)]
    sequences = [prompt + [rng.randrange(VOCAB) for _ in range(50)] for _ in range(20)]
    the_plan, _ = check_plan(build(family), sequences, 300, reference=True)
    assert max(len(_piece_roots(the_plan, piece)) for piece in the_plan.pieces) > 1  # pieces with several roots


def _piece_roots(the_plan, piece) -> set:
    """Segments of ``piece`` whose parent segment lies outside it."""
    parent = the_plan.packed.segment_parent.tolist()
    inside = set(piece.segments)
    return {s for s in piece.segments if parent[s] not in inside}


@pytest.mark.parametrize("family", ["qwen3_next"])
def test_whole_trees_sharing_a_microbatch_run_as_one_piece(family):
    """Small whole trees placed in one microbatch become one piece (one forward and backward, as a microbatch
    promises), next to a large tree cut into hand-off pieces; still exact against one tree forward and the
    per-trajectory path."""
    rng = random.Random(1)
    small = [[VOCAB - 1 - i] + [rng.randrange(VOCAB) for _ in range(rng.randrange(12, 30))] for i in range(8)]
    sequences = handoff_sequences() + small
    the_plan, run = check_plan(build(family), sequences, 140, reference=True)
    parent = the_plan.packed.segment_parent.tolist()
    top_level = [sum(parent[s] < 0 for s in piece.segments) for piece in the_plan.pieces]
    assert max(top_level) > 1  # a piece made of several whole trees
    trees = sum(p < 0 for p in parent)
    assert len(the_plan.pieces) < trees + sum(p.handoff is not None for p in the_plan.pieces)
    sources = {p.handoff.source_piece for p in the_plan.pieces if p.handoff is not None}
    for slots in the_plan.replicas:
        for microbatch in slots:
            whole = [i for i in microbatch.pieces if the_plan.pieces[i].handoff is None and i not in sources]
            assert len(whole) <= 1, microbatch
    assert [p.index for p in the_plan.pieces] == list(range(len(the_plan.pieces)))
    assert sorted(s for p in the_plan.pieces for s in p.segments) == list(range(len(parent)))


def test_only_loss_tokens_and_top1_match_the_tree_forward():
    """execute_plan(only_loss_tokens=True, compute_top1=True) over pieces with hand-offs: the LM head scores only the
    tokens that carry loss in some sequence (masks that differ between sequences sharing a token); their log-probs and
    argmax flags equal one tree forward's (tree_logprobs with the same options), the other places hold 0 / False
    and reach no loss, and the gradient of a loss over each sequence's own loss places equals the tree forward's."""
    sequences = handoff_sequences(seed=3)
    rng = random.Random(3)
    masks = [torch.tensor([rng.random() < 0.5 for _ in s]) for s in sequences]
    forest = PrefixForest.from_sequences(sequences, loss_masks=masks)
    the_plan = plan(forest, token_budget=140)
    assert sum(p.handoff is not None for p in the_plan.pieces) >= 3
    model = build("qwen3_next")
    weights = [w * m[1:] for w, m in zip(weights_for(sequences), masks)]  # each sequence's own loss places
    tree = tree_logprobs(model, forest=forest, only_loss_tokens=True, compute_top1=True)
    loss = sum((x * w).sum() for x, w in zip(tree.logprobs, weights))
    model.zero_grad()
    loss.backward()
    expected_grads = grads_of(model)
    scored_places = []

    def loss_fn(scored):
        scored_places.append(torch.stack([scored.sequence, scored.position]))
        assert scored.is_top1 is not None and scored.is_top1.shape == scored.logprobs.shape
        weight = torch.stack([torch.nn.functional.pad(w, (0, 400 - w.shape[0])) for w in weights])
        return (weight[scored.sequence, scored.position] * scored.logprobs[scored.occurrence]).sum()

    model.zero_grad()
    run = execute_plan(model, the_plan, loss_fn=loss_fn, only_loss_tokens=True, compute_top1=True)
    compare_grads(grads_of(model), expected_grads, 3e-5, "only_loss_tokens plan vs tree")
    packed = forest.pack()
    carries = [x[1:] for x in packed.gather_sequences(packed.loss_mask)]  # the token carries loss in some sequence
    for got, want, top1, want_top1, scored in zip(run.logprobs, tree.logprobs, run.is_top1, tree.is_top1, carries):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert torch.equal(top1, want_top1) and not got[~scored].any() and not top1[~scored].any()
    places = torch.cat(scored_places, 1)
    assert places.shape[1] == sum(int(c.sum()) for c in carries)  # exactly the scored tokens' places, once each
    with torch.no_grad():
        forward_only = execute_plan(model, the_plan, only_loss_tokens=True, compute_top1=True)
    assert all(torch.equal(a, b) for a, b in zip(forward_only.is_top1, run.is_top1))


def test_mamba2_half_scan_inputs_across_pieces(monkeypatch):
    """Nemotron-H under bf16 autocast with the scan's inputs in bf16 (``mamba2.SCAN_INPUTS = "half"``): planner pieces
    hand their conv rows, states and replay rows over in that dtype, and differ from one tree forward no more than
    they do with the scan in fp32 (bf16 rounding of the pieces' own products; within 1.5x)."""
    from harts_hf.model_patches import mamba2

    sequences = handoff_sequences()
    weights = weights_for(sequences)
    gaps = {}
    for setting in ("fp32", "half"):
        monkeypatch.setattr(mamba2, "SCAN_INPUTS", setting)
        model = build("nemotron_h")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            run = execute_plan(model, plan(sequences, token_budget=140), logprob_weights=weights)
            pieces = grads_of(model)
            model.zero_grad()
            tree = tree_logprobs(model, sequences)
            loss = sum((x.float() * w).sum() for x, w in zip(tree.logprobs, weights))
        loss.backward()
        whole = grads_of(model)
        gaps[setting] = (max_relative(run.logprobs, tree.logprobs),
                         max(((pieces[n] - whole[n]).norm() / whole[n].norm()).item() for n in whole
                             if whole[n] is not None and whole[n].norm() > 0))
    assert all(a <= 1.5 * b + 1e-6 for a, b in zip(gaps["half"], gaps["fp32"])), gaps
