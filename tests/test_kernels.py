"""Tree kernels against their per-path references: outputs and every input gradient (fp64 and fp32, CPU)."""

import random

import pytest
import torch

from harts_hf.kernels import (
    build_gated_delta_plan,
    build_varlen_layout,
    tree_attention,
    tree_attention_reference,
    tree_causal_conv1d,
    tree_causal_conv1d_reference,
    tree_gated_delta_rule,
    tree_gated_delta_rule_reference,
)
from harts_hf.kernels._backend import resolve_backend
from harts_hf.trees import PrefixForest
from tests.forests import chunk_edge_sequences, random_tree_sequences

FORESTS = {
    "chunk_edges": chunk_edge_sequences(),
    "random_a": random_tree_sequences(random.Random(1), 10),
    "random_b": random_tree_sequences(random.Random(2), 14, max_tail=150),
    "deep_chain": [list(range(1, 260)), list(range(1, 140)) + [0]],
    "fan_out": [[5] * 66 + [k] for k in range(24)] + [[5] * 10 + [k, k] for k in range(8)],
    "single_tokens": [[1], [1], [2], [1, 3]],
}
TOLERANCE = {torch.float64: dict(rtol=1e-9, atol=1e-10), torch.float32: dict(rtol=1e-5, atol=1e-5)}


def assert_same_as_dense_path(out, inputs, packed, scaling=0.3):
    """``out`` (fp64) and the gradients of a random weighted sum of it equal the dense-mask path's on ``inputs``
    (q, k, v); returns that path's output and the weights."""
    expected = tree_attention(*inputs, packed.subtree_end, scaling=scaling, backend="sdpa")
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float64])
    weight = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad((out * weight).sum(), inputs),
                    torch.autograd.grad((expected * weight).sum(), inputs)):
        torch.testing.assert_close(a, b, **TOLERANCE[torch.float64])
    return expected, weight


def assert_paths_match(packed, tree_out, reference, inputs, dtype):
    """Compare per-path outputs and the gradients of a random weighted sum of them."""
    tree_paths = packed.gather_sequences(tree_out)
    for a, b in zip(tree_paths, reference):
        torch.testing.assert_close(a, b, **TOLERANCE[dtype])
    weights = [torch.randn_like(r) for r in reference]
    grads_tree = torch.autograd.grad(sum((a * w).sum() for a, w in zip(tree_paths, weights)), inputs, allow_unused=True)
    grads_ref = torch.autograd.grad(sum((b * w).sum() for b, w in zip(reference, weights)), inputs, allow_unused=True)
    for a, b in zip(grads_tree, grads_ref):
        scale = b.abs().max().clamp_min(1e-12)
        torch.testing.assert_close(a / scale, b / scale, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", list(FORESTS))
@pytest.mark.parametrize("final_states_only", [False, True])
@pytest.mark.parametrize("gates", ["per_head", "per_channel"])
def test_tree_gated_delta_rule(name, dtype, final_states_only, gates):
    """Gated DeltaNet (one decay per head) and Kimi Delta Attention (one per key channel)."""
    torch.manual_seed(0)
    packed = PrefixForest.from_sequences(FORESTS[name]).pack()
    U, HK, HV, K, V = packed.num_tokens, 2, 4, 8, 6
    q = torch.randn(U, HK, K, dtype=dtype, requires_grad=True)
    k = torch.randn(U, HK, K, dtype=dtype, requires_grad=True)
    v = torch.randn(U, HV, V, dtype=dtype, requires_grad=True)
    g = (-torch.rand(U, HV, *((K,) if gates == "per_channel" else ()), dtype=dtype) * 0.3).requires_grad_()
    beta = torch.rand(U, HV, dtype=dtype).requires_grad_()
    plan = build_gated_delta_plan(packed, final_states_only=final_states_only)
    out = tree_gated_delta_rule(q, k, v, g, beta, plan, use_qk_l2norm_in_kernel=True, backend="torch")
    reference = tree_gated_delta_rule_reference(q, k, v, g, beta, packed, use_qk_l2norm_in_kernel=True)
    assert_paths_match(packed, out, reference, (q, k, v, g, beta), dtype)
    assert plan.stats["max_replay"] <= 63


def test_gated_delta_rule_chunked_matches_recurrence():
    torch.manual_seed(0)
    packed = PrefixForest.from_sequences(FORESTS["random_a"]).pack()
    U = packed.num_tokens
    q, k = torch.randn(U, 1, 4, dtype=torch.float64), torch.randn(U, 1, 4, dtype=torch.float64)
    v, g, beta = torch.randn(U, 2, 3, dtype=torch.float64), -torch.rand(U, 2, dtype=torch.float64), torch.rand(U, 2, dtype=torch.float64)
    chunked = tree_gated_delta_rule_reference(q, k, v, g, beta, packed, use_qk_l2norm_in_kernel=True, scale=0.3)
    recurrent = tree_gated_delta_rule_reference(q, k, v, g, beta, packed, use_qk_l2norm_in_kernel=True, scale=0.3, recurrent=True)
    for a, b in zip(chunked, recurrent):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("decay", [0.3, 12.0])
def test_per_channel_gates_chunked_match_recurrence(decay):
    """Kimi Delta Attention's per-channel decays, chunked (the tree's torch backend) against the token-by-token
    recurrence, fp64; decays up to e^-12 per token (a chunk's total far past fp32's range when factored) stay
    finite."""
    torch.manual_seed(0)
    packed = PrefixForest.from_sequences(FORESTS["random_b"]).pack()
    U = packed.num_tokens
    q, k = torch.randn(U, 2, 4, dtype=torch.float64), torch.randn(U, 2, 4, dtype=torch.float64)
    v, beta = torch.randn(U, 2, 3, dtype=torch.float64), torch.rand(U, 2, dtype=torch.float64)
    g = -torch.rand(U, 2, 4, dtype=torch.float64) * decay
    chunked = tree_gated_delta_rule_reference(q, k, v, g, beta, packed, use_qk_l2norm_in_kernel=True)
    recurrent = tree_gated_delta_rule_reference(q, k, v, g, beta, packed, use_qk_l2norm_in_kernel=True, recurrent=True)
    for a, b in zip(chunked, recurrent):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
    plan = build_gated_delta_plan(packed)
    out = tree_gated_delta_rule(q.float(), k.float(), v.float(), g.float(), beta.float(), plan,
                                use_qk_l2norm_in_kernel=True)
    assert torch.isfinite(out).all()
    for a, b in zip(packed.gather_sequences(out), recurrent):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["chunk_edges", "random_b", "fan_out", "single_tokens"])
@pytest.mark.parametrize("chunk_size", [16, 64])
def test_gated_linear_attention_without_delta(name, chunk_size):
    """``delta=False`` (Mamba-2's scan: ``S = exp(g) S + k (beta v)^T``, q = C, k = B, v = dt x): the tree on a plan of
    the mixer's chunk size against the token-by-token recurrence on every path, outputs and every input gradient,
    fp64; and the chunked reference against the recurrence."""
    torch.manual_seed(0)
    packed = PrefixForest.from_sequences(FORESTS[name]).pack()
    U = packed.num_tokens
    q, k = (torch.randn(U, 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    v = torch.randn(U, 4, 6, dtype=torch.float64, requires_grad=True)
    g = (-torch.rand(U, 4, dtype=torch.float64) * 0.5).requires_grad_()
    beta = torch.ones(U, 4, dtype=torch.float64, requires_grad=True)
    plan = build_gated_delta_plan(packed, chunk_size=chunk_size)
    out = tree_gated_delta_rule(q, k, v, g, beta, plan, scale=1.0, backend="torch", delta=False)
    reference = tree_gated_delta_rule_reference(q, k, v, g, beta, packed, scale=1.0, recurrent=True, delta=False)
    assert_paths_match(packed, out, reference, (q, k, v, g, beta), torch.float64)
    chunked = tree_gated_delta_rule_reference(q, k, v, g, beta, packed, scale=1.0, chunk_size=chunk_size, delta=False)
    for a, b in zip(chunked, reference):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_plan_replay_and_rounds():
    # forks at depths 64 (aligned: no replay), 65 (1 replayed token), 127 (63 replayed tokens); the base path
    # is every branch point's first child, so it continues its run and replays nothing
    base = list(range(1, 201))
    packed = PrefixForest.from_sequences([base, base[:64] + [0], base[:65] + [0], base[:127] + [0]]).pack()
    plan = build_gated_delta_plan(packed)
    assert plan.stats["runs"] == 4
    assert plan.stats["replay_tokens"] == 0 + 1 + 63
    assert plan.stats["max_replay"] == 63
    assert plan.stats["rounds"] == 2
    cut = build_gated_delta_plan(packed, final_states_only=True)
    assert cut.stats["replay_tokens"] == plan.stats["replay_tokens"]
    assert cut.stats["units"] > plan.stats["units"]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", list(FORESTS))
@pytest.mark.parametrize("width, activation, with_bias", [(4, "silu", False), (3, None, True), (1, "silu", True)])
def test_tree_causal_conv1d(name, dtype, width, activation, with_bias):
    torch.manual_seed(0)
    packed = PrefixForest.from_sequences(FORESTS[name]).pack()
    C = 6
    x = torch.randn(packed.num_tokens, C, dtype=dtype, requires_grad=True)
    weight = torch.randn(C, width, dtype=dtype, requires_grad=True)
    bias = torch.randn(C, dtype=dtype, requires_grad=True) if with_bias else None
    out = tree_causal_conv1d(x, weight, bias, packed.ancestor_table(width), activation)
    reference = tree_causal_conv1d_reference(x, weight, bias, packed, activation)
    inputs = (x, weight) + ((bias,) if with_bias else ())
    assert_paths_match(packed, out, reference, inputs, dtype)


def test_tree_causal_conv1d_bf16_inputs_round_once():
    """bf16 activations with fp32 weights (autocast with fp32 master weights): the conv computes in fp32, so the
    output and x's gradient are the fp64 result rounded to bf16 once (<= half a bf16 ulp of the largest entry;
    promoting inside each of the W products would round every term's gradient: ~0.7% was measured)."""
    torch.manual_seed(0)
    packed = PrefixForest.from_sequences(random_tree_sequences(random.Random(3), 12, 40)).pack()
    U, C, W = packed.num_tokens, 16, 4
    x = torch.randn(U, C).bfloat16().requires_grad_()
    weight, bias = torch.randn(C, W, requires_grad=True), torch.randn(C, requires_grad=True)
    grad = torch.randn(U, C).bfloat16()  # the output is bf16, so is its gradient
    out = tree_causal_conv1d(x, weight, bias, packed.ancestor_table(W), "silu")
    assert out.dtype == torch.bfloat16
    (grad_x,) = torch.autograd.grad(out, x, grad)
    x64 = x.detach().double().requires_grad_()
    exact = tree_causal_conv1d(x64, weight.detach().double(), bias.detach().double(), packed.ancestor_table(W), "silu")
    (exact_grad,) = torch.autograd.grad(exact, x64, grad.double())
    half_ulp = 2.0 ** -8  # relative, bf16's 8-bit significand
    for got, want in ((out, exact), (grad_x, exact_grad)):
        assert float((got.double() - want).abs().max() / want.abs().max()) <= half_ulp * 1.01


def test_conv_window_fixups_are_the_first_tokens_of_runs():
    """The tree conv takes every token's window from the packed rows before it except where a run starts (below
    a branch point, or a root after position 0): its first ``W - 1`` tokens are recomputed from the ancestor
    table, and only they."""
    from harts_hf.kernels.tree_conv1d import conv_window_fixups

    for sequences in FORESTS.values():
        packed = PrefixForest.from_sequences(sequences).pack()
        parent, U = packed.parent.tolist(), packed.num_tokens
        starts = [t for t in range(U) if parent[t] != t - 1] + [U]
        for width in (1, 3, 4):
            expected = [t for s, end in zip(starts, starts[1:]) if s > 0 for t in range(s, min(s + width - 1, end))]
            assert conv_window_fixups(packed.ancestor_table(width), width).tolist() == expected, (sequences, width)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", list(FORESTS))
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 8), (2, 2, 256), (6, 1, 16)])
def test_tree_attention(name, dtype, heads, kv_heads, head_dim):
    torch.manual_seed(0)
    packed = PrefixForest.from_sequences(FORESTS[name]).pack()
    U = packed.num_tokens
    q = torch.randn(U, heads, head_dim, dtype=dtype, requires_grad=True)
    k = torch.randn(U, kv_heads, head_dim, dtype=dtype, requires_grad=True)
    v = torch.randn(U, kv_heads, head_dim, dtype=dtype, requires_grad=True)
    reference = tree_attention_reference(q, k, v, packed, scaling=0.2)
    out = tree_attention(q, k, v, packed.subtree_end, scaling=0.2)
    assert_paths_match(packed, out, reference, (q, k, v), dtype)
    by_runs = tree_attention(q, k, v, packed.subtree_end, scaling=0.2, backend="runs",
                             layout=build_varlen_layout(packed))
    assert_paths_match(packed, by_runs, tree_attention_reference(q, k, v, packed, scaling=0.2), (q, k, v), dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", list(FORESTS))
@pytest.mark.parametrize("context", [0, 5])
@pytest.mark.parametrize("key_block", [None, 8])
def test_tree_attention_split_by_runs_merges_exactly(name, dtype, context, key_block):
    """The cuDNN path's decomposition (per run: ancestors without a mask + itself causally, merged by log-sum-exp;
    each block's backward given the merged out/lse) with explicit softmax blocks, against the dense-mask path:
    outputs and the gradients of q, k, v and the context keys/values. ``key_block=8``: the bucketed shapes (8-key
    ancestor blocks, the rest in the causal block behind zero queries, rows padded to powers of two / multiples of
    16)."""
    import dataclasses

    from harts_hf.kernels.tree_attention.split import bucket_rows, run_blocks, tree_attention_split

    torch.manual_seed(0)
    packed = PrefixForest.from_sequences(FORESTS[name]).pack()
    # as a planner piece: tokens keep their depths in the whole tree, below `context` ancestors
    packed = dataclasses.replace(packed, position_ids=packed.position_ids + context)
    U, HQ, HKV, D = packed.num_tokens, 4, 2, 8
    q = torch.randn(U, HQ, D, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(U, HKV, D, dtype=dtype, requires_grad=True) for _ in range(2))
    ck, cv = (torch.randn(context, HKV, D, dtype=dtype, requires_grad=True) for _ in range(2))
    layout = build_varlen_layout(packed, context_tokens=context)
    blocks = run_blocks(layout, key_block=key_block, row_multiple=16)
    assert run_blocks(layout, key_block=key_block, row_multiple=16) is blocks  # cached on the layout
    if key_block:
        assert all(keys == key_block for _, keys, causal in blocks.shapes() if not causal)
        assert all(rows == bucket_rows(rows, 16) for rows, _, _ in blocks.shapes())
    extra = dict(context_k=ck, context_v=cv) if context else {}
    expected = tree_attention(q, k, v, packed.subtree_end, scaling=0.3, backend="sdpa", **extra)
    out = tree_attention_split(q, torch.cat([k, ck]), torch.cat([v, cv]), blocks, scaling=0.3, primitive="math")
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
    inputs = (q, k, v) + ((ck, cv) if context else ())
    weight = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad((out * weight).sum(), inputs),
                    torch.autograd.grad((expected * weight).sum(), inputs)):
        scale = b.abs().max().clamp_min(1e-12)
        torch.testing.assert_close(a / scale, b / scale, **TOLERANCE[dtype])
    assert blocks.pairs == packed.stats()["tree_attention_pairs"]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", list(FORESTS) + ["two_trees"])
@pytest.mark.parametrize("context", [0, 5])
@pytest.mark.parametrize("every", [True, False], ids=["every_segment", "worth_it"])
def test_tree_attention_with_shared_keys_in_place_merges_exactly(name, dtype, context, every, monkeypatch):
    """varlen.SHARED_KEYS_IN_PLACE: key segments ending at branch points attended by every row below them in one
    unmasked call on the rows as they are (``every``: every such segment, nested ones merged in turn; else those the
    default rule picks), context rows by every query, the runs' remaining paths in the varlen call, merged by
    log-sum-exp, each call's backward given the merged out/lse. With explicit softmax per sequence against the
    dense-mask path: outputs and the gradients of q, k, v and the context keys/values (values narrower than keys, as
    MLA's); fewer gathered key rows; calls cut by the element limit give the same."""
    import dataclasses

    from harts_hf.kernels.tree_attention import shared_keys, varlen

    torch.manual_seed(0)
    sequences = FORESTS["fan_out"] + FORESTS["random_a"] if name == "two_trees" else FORESTS[name]
    packed = PrefixForest.from_sequences(sequences).pack()
    packed = dataclasses.replace(packed, position_ids=packed.position_ids + context)
    U, HQ, HKV, D, DV = packed.num_tokens, 4, 2, 8, 6
    q = torch.randn(U, HQ, D, dtype=dtype, requires_grad=True)
    k = torch.randn(U, HKV, D, dtype=dtype, requires_grad=True)
    v = torch.randn(U, HKV, DV, dtype=dtype, requires_grad=True)
    ck = torch.randn(context, HKV, D, dtype=dtype, requires_grad=True)
    cv = torch.randn(context, HKV, DV, dtype=dtype, requires_grad=True)
    layout = build_varlen_layout(packed, context_tokens=context)
    setting = dict(row_ratio=0.0, min_saved_rows=1) if every else dict(row_ratio=1.0, min_saved_rows=64)
    split = shared_keys.shared_segment_split(layout, **setting)
    assert shared_keys.shared_segment_split(layout, **setting) is split  # cached on the layout
    branch_segments = int(((packed.subtree_end - torch.arange(U)) > 1).sum())  # an upper bound on their number
    segments = [b for b in split.blocks if b[2] < U]
    assert len(split.blocks) == len(segments) + (context > 0) and len(segments) <= branch_segments
    if every and name != "single_tokens":
        assert len(segments) >= 2 if name in ("random_a", "random_b", "fan_out", "two_trees") else segments
    if split.blocks:
        assert split.saved_rows > 0 and split.rest.key_index.numel() == layout.key_index.numel() - split.saved_rows
    assert split.rest.host_cu()[0][-1] == U and split.rest.context_tokens == 0
    pad = torch.zeros(U, HKV, D - DV, dtype=dtype)  # the dense path wants one head dim: pad v, drop the pad after
    padded_cv = torch.cat([cv, torch.zeros(context, HKV, D - DV, dtype=dtype)], dim=-1)
    expected = tree_attention(q, k, torch.cat([v, pad], dim=-1), packed.subtree_end, scaling=0.3, backend="sdpa",
                              **(dict(context_k=ck, context_v=padded_cv) if context else {}))[..., :DV]
    inputs = (q, k, v) + ((ck, cv) if context else ())
    weight = torch.randn(U, HQ, DV, dtype=dtype)
    expected_grads = torch.autograd.grad((expected * weight).sum(), inputs)
    for limit in (varlen.MAX_CALL_ELEMENTS, (varlen.PAD_ROWS + 400) * HQ * D):
        monkeypatch.setattr(varlen, "MAX_CALL_ELEMENTS", limit)
        out = shared_keys.tree_attention_shared_keys(q, torch.cat([k, ck]), torch.cat([v, cv]), split, scaling=0.3,
                                                     primitive="math")
        torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
        for a, b in zip(torch.autograd.grad((out * weight).sum(), inputs), expected_grads):
            scale = b.abs().max().clamp_min(1e-12)
            torch.testing.assert_close(a / scale, b / scale, **TOLERANCE[dtype])


def test_shared_keys_in_place_through_the_fa4_dispatcher_ops(monkeypatch):
    """The "fa4" primitive: harts::fa4_varlen_fwd / _bwd with ``causal`` False for the unmasked blocks and True for
    the rest, FlashAttention-4's functions stood in for by the explicit-softmax primitive (they need a Hopper GPU):
    the same outputs and gradients as the dense-mask path."""
    from harts_hf.kernels.tree_attention import fa4, shared_keys

    seen = []

    def forward(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, softcap,
                window_size_left, window_size_right, learnable_sink, return_lse):
        assert softcap is None and window_size_left is None and learnable_sink is None and return_lse
        seen.append(causal)
        return (*shared_keys._math_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                           softmax_scale), None, None, None)

    def backward(q, k, v, out, dout, lse, *, softmax_scale, causal, softcap, window_size_left, window_size_right,
                 cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, learnable_sink):
        return shared_keys._math_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                          max_seqlen_k, causal, softmax_scale)

    monkeypatch.setattr(fa4, "check_interface", lambda: (forward, backward))
    torch.manual_seed(0)
    packed = PrefixForest.from_sequences(FORESTS["fan_out"]).pack()
    U = packed.num_tokens
    q = torch.randn(U, 4, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(U, 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    split = shared_keys.shared_segment_split(build_varlen_layout(packed), 0.0, 1)
    out = shared_keys.tree_attention_shared_keys(q, k, v, split, scaling=0.3, primitive="fa4")
    expected, weight = assert_same_as_dense_path(out, (q, k, v), packed)
    assert True in seen and False in seen
    # under checkpointing with the keep-attention policy the backward's rerun calls no attention forward again
    from torch.utils.checkpoint import checkpoint

    from harts_hf.model_patches.checkpointing import _attention_contexts

    for contexts, rerun in ((_attention_contexts, False), (None, True)):
        seen.clear()
        again = checkpoint(lambda q, k, v: shared_keys.tree_attention_shared_keys(q * 1.0, k, v, split, 0.3, "fa4"),
                           q, k, v, use_reentrant=False, **({} if contexts is None else {"context_fn": contexts}))
        calls = len(seen)
        torch.autograd.grad((again * weight).sum(), (q, k, v))
        assert (len(seen) > calls) == rerun and torch.allclose(again, expected, atol=1e-12)


def test_shared_keys_in_place_only_with_plain_attention(monkeypatch):
    """SHARED_KEYS_IN_PLACE routes tree_attention_varlen to the shared-keys path (the flash primitive on torch's
    kernel, fa4 on FlashAttention-4) only without window, softcapping or sinks, and only where a segment is worth
    splitting off; off (the default), the plain varlen call."""
    from harts_hf.kernels.tree_attention import shared_keys, varlen

    packed = PrefixForest.from_sequences(FORESTS["fan_out"]).pack()
    layout = build_varlen_layout(packed)
    q = torch.randn(packed.num_tokens, 4, 8)
    k = v = torch.randn(packed.num_tokens, 2, 8)
    calls = []
    monkeypatch.setattr(shared_keys, "tree_attention_shared_keys", lambda *a, **kw: calls.append(a[-1]) or q)
    monkeypatch.setattr(varlen, "_varlen_call", lambda *a, **kw: calls.append("plain") or q)
    kernel = ["torch"]
    monkeypatch.setattr(varlen, "varlen_kernel", lambda device, choice=None: kernel[0])
    assert not varlen.SHARED_KEYS_IN_PLACE
    varlen.tree_attention_varlen(q, k, v, layout)
    monkeypatch.setattr(varlen, "SHARED_KEYS_IN_PLACE", True)
    monkeypatch.setattr(shared_keys, "MIN_SAVED_ROWS", 10_000)
    varlen.tree_attention_varlen(q, k, v, layout)  # no segment saves that many rows
    monkeypatch.setattr(shared_keys, "MIN_SAVED_ROWS", 1024)  # 56 rows under 24 runs do
    varlen.tree_attention_varlen(q, k, v, layout)
    varlen.tree_attention_varlen(q, k, v, layout, window=16)
    kernel[0] = "fa4"
    varlen.tree_attention_varlen(q, k, v, layout)
    assert calls == ["plain", "plain", "flash", "plain", "fa4"]
    monkeypatch.undo()
    with pytest.raises(ValueError, match="primitive must be one of"):
        shared_keys.tree_attention_shared_keys(q, k, v, shared_keys.shared_segment_split(layout, 0.0, 1),
                                               primitive="nope")


def test_gather_rows_sums_repeated_rows_in_fp32_and_rounds_once(monkeypatch):
    """The varlen/runs key gather: a shared prefix row is gathered once per run; its gradient is the fp32 sum
    rounded to bf16 once (the plain backward rounds after every bf16 addition), in blocks of rows."""
    from harts_hf.kernels.tree_attention import varlen

    monkeypatch.setattr(varlen._GatherRows, "BLOCK", 7)
    torch.manual_seed(0)
    x = torch.randn(5, 2, 3, dtype=torch.bfloat16, requires_grad=True)
    index = torch.tensor([0, 1, 2] * 20 + [3, 0, 4] * 10)
    grad = torch.randn(index.shape[0], 2, 3, dtype=torch.bfloat16)
    varlen.gather_rows(x, index).backward(grad)
    exact = torch.zeros(5, 2, 3, dtype=torch.float64).index_add_(0, index, grad.double())
    assert torch.equal(x.grad, exact.to(torch.bfloat16))
    rounding_each_time = torch.zeros(5, 2, 3, dtype=torch.bfloat16)  # CUDA's bf16 atomic adds, one at a time
    for row, value in zip(index.tolist(), grad):
        rounding_each_time[row] += value
    assert not torch.equal(rounding_each_time, x.grad)  # the case this guards against
    assert torch.equal(varlen.gather_rows(x, index), x[index])


def test_bucket_rows():
    from harts_hf.kernels.tree_attention.split import bucket_rows

    assert [bucket_rows(n, 1024) for n in (1, 2, 3, 64, 65, 1000, 1024, 1025, 2048, 2049)] == [
        1, 2, 4, 64, 128, 1024, 1024, 2048, 2048, 3072]


def _varlen_attn_by_sequence(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, window_size=(-1, 0), **_):
    """torch's ``varlen_attn`` semantics (bottom-right causal, GQA) one sequence at a time: the per-run SDPA path on
    keys given in place (an identity key index). The kernel itself is CUDA-only; this stands in for it to test how
    calls are cut (the kernel is checked on the GPU)."""
    from harts_hf.kernels.tree_attention.ops import _attention_by_runs
    from harts_hf.kernels.tree_attention.varlen import VarlenLayout

    assert window_size == (-1, 0)
    assert max_q >= int((cu_q[1:] - cu_q[:-1]).max()) and max_k >= int((cu_k[1:] - cu_k[:-1]).max())
    return _attention_by_runs(q, k, v, VarlenLayout(torch.arange(k.shape[0]), cu_q, cu_k, max_q, max_k), scale)


def test_varlen_calls_are_cut_below_the_kernels_32_bit_offsets(monkeypatch):
    """Layouts past MAX_CALL_ELEMENTS (query or gathered key elements) run as several varlen calls over consecutive
    runs; outputs and every gradient equal the dense per-path reference; one oversized run is refused with the fix."""
    import torch.nn.attention.varlen as torch_varlen

    from harts_hf.kernels.tree_attention import varlen

    packed = PrefixForest.from_sequences(FORESTS["random_b"]).pack()
    layout = build_varlen_layout(packed)
    cu_q, cu_k = layout.host_cu()
    U, HQ, HKV, D = packed.num_tokens, 4, 2, 8
    assert varlen.varlen_call_groups(cu_q, cu_k, HQ * D, HKV * D) == [(0, len(cu_q) - 1)]
    pad = varlen.PAD_ROWS
    limit = max(HQ * D * (pad + max(b - a for a, b in zip(cu_q, cu_q[1:]))),  # the longest run or path fits exactly
                HKV * D * (pad + max(b - a for a, b in zip(cu_k, cu_k[1:]))))
    groups = varlen.varlen_call_groups(cu_q, cu_k, HQ * D, HKV * D, limit)
    assert len(groups) > 2 and groups[0][0] == 0 and groups[-1][1] == len(cu_q) - 1
    assert all(a[1] == b[0] for a, b in zip(groups, groups[1:]))
    for r0, r1 in groups:
        padding = pad * (r1 - r0)
        assert r1 > r0 and (cu_q[r1] - cu_q[r0] + padding) * HQ * D <= limit
        assert (cu_k[r1] - cu_k[r0] + padding) * HKV * D <= limit
    with pytest.raises(ValueError, match="tree_token_budget"):
        varlen.varlen_call_groups(cu_q, cu_k, HQ * D, HKV * D, limit - 1)

    monkeypatch.setattr(torch_varlen, "varlen_attn", _varlen_attn_by_sequence)
    monkeypatch.setattr(varlen, "MAX_CALL_ELEMENTS", limit)
    torch.manual_seed(0)
    q = torch.randn(U, HQ, D, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(U, HKV, D, dtype=torch.float64, requires_grad=True) for _ in range(2))
    out = varlen.tree_attention_varlen(q, k, v, layout, scaling=0.3)
    assert_same_as_dense_path(out, (q, k, v), packed)


def test_conv_bulk_backend_choice():
    """The model's conv bulk: always the shifted torch sums on CPU; on CUDA 'auto' is fla's fused conv where it
    imports (measured faster on the H200), else torch; a wrong name is refused."""
    from harts_hf.kernels.tree_conv1d import ops

    cpu = torch.zeros(2, 3)
    assert ops.bulk_backend(cpu) == "torch" and ops.bulk_backend(cpu, "fla") == "torch"
    with pytest.raises(ValueError, match="BULK_BACKEND must be"):
        ops.bulk_backend(cpu, "triton")
    if torch.cuda.is_available():
        cuda = cpu.cuda()
        assert ops.bulk_backend(cuda, "auto") == ("fla" if ops._fla_conv_importable() else "torch")
        assert ops.bulk_backend(cuda, "torch") == "torch"


def test_auto_attention_takes_cudnn_only_for_long_runs():
    """CUDA 'auto': cuDNN per run once runs average >= CUDNN_MIN_PAIRS_PER_RUN pairs (their plans repay), flash
    varlen for the many short runs of small trees."""
    from harts_hf.kernels.tree_attention.ops import CUDNN_MIN_PAIRS_PER_RUN, cuda_backend

    long_run = int((2 * CUDNN_MIN_PAIRS_PER_RUN) ** 0.5) + 2
    assert cuda_backend(build_varlen_layout(PrefixForest.from_sequences([list(range(long_run))]).pack())) == "cudnn"
    assert cuda_backend(build_varlen_layout(PrefixForest.from_sequences(FORESTS["random_b"]).pack())) == "varlen"


def test_cudnn_attention_ops_keep_their_schema():
    """Contract: the private aten ops the cuDNN path calls, with the argument order it passes."""
    forward = [a.name for a in torch.ops.aten._scaled_dot_product_cudnn_attention.default._schema.arguments]
    assert forward == ["query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p", "is_causal",
                       "return_debug_mask", "scale"]
    backward = [a.name for a in torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default._schema.arguments]
    assert backward == ["grad_out", "query", "key", "value", "out", "logsumexp", "philox_seed", "philox_offset",
                        "attn_bias", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal", "scale"]


def test_tree_attention_cudnn_needs_cuda_and_a_layout():
    packed = PrefixForest.from_sequences(FORESTS["random_a"]).pack()
    U = packed.num_tokens
    q, k = torch.randn(U, 2, 8), torch.randn(U, 2, 8)
    with pytest.raises(ValueError, match="backend='cudnn' needs CUDA tensors and a VarlenLayout"):
        tree_attention(q, k, k, packed.subtree_end, backend="cudnn", layout=build_varlen_layout(packed))


def test_tree_attention_under_autocast_runs_in_the_autocast_dtype():
    """fp32 weights + bf16 autocast leave q/k in fp32 (RoPE) and v in bf16: the kernel sees what SDPA would."""
    torch.manual_seed(0)
    packed = PrefixForest.from_sequences(FORESTS["random_a"]).pack()
    U = packed.num_tokens
    q, k = torch.randn(U, 4, 16), torch.randn(U, 2, 16)
    v = torch.randn(U, 2, 16, dtype=torch.bfloat16)
    context_k, context_v = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    for context in (False, True):
        extra = dict(context_k=context_k, context_v=context_v) if context else {}
        expected = tree_attention(q.bfloat16(), k.bfloat16(), v, packed.subtree_end, scaling=0.25,
                                  **{key: t.bfloat16() for key, t in extra.items()})
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = tree_attention(q, k, v, packed.subtree_end, scaling=0.25, **extra)
        assert out.dtype == torch.bfloat16
        assert torch.equal(out, expected)


def test_cpu_tensors_never_take_the_triton_backend(monkeypatch):
    import harts_hf.kernels._backend as backend

    monkeypatch.setattr(backend, "fla_available", lambda: True)  # as on a machine with fla and triton installed
    assert resolve_backend("auto", torch.zeros(1), "op") == "torch"
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        resolve_backend("fla", torch.zeros(1), "op")
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve_backend("triton", torch.zeros(1), "op")


def test_cpu_backend_choice_is_logged_once(caplog):
    import harts_hf.kernels._backend as backend

    backend._log_once.cache_clear()
    with caplog.at_level("INFO", logger="harts_hf"):
        for _ in range(3):
            assert resolve_backend("auto", torch.zeros(1), "op") == "torch"
    assert [r.getMessage() for r in caplog.records].count(
        "harts_hf: tree kernels on CPU tensors take the PyTorch backends") == 1


def test_fla_backward_refusal_is_named_before_it_happens():
    from harts_hf.kernels._backend import fla_backward_problem

    assert "install tilelang" in fla_backward_problem((9, 0), "3.6.0", has_tilelang=False)
    assert fla_backward_problem((9, 0), "3.6.0", has_tilelang=True) is None
    assert fla_backward_problem((9, 0), "3.7.1", has_tilelang=False) is None
    assert fla_backward_problem((8, 0), "3.6.0", has_tilelang=False) is None  # only Hopper is affected
    assert fla_backward_problem((10, 0), "3.5.0+git1234", has_tilelang=False) is None


def test_chunk_grid_of_plan_rounds_matches_their_units():
    packed = PrefixForest.from_sequences(random_tree_sequences(random.Random(3), 10, vocab=3, max_tail=150)).pack()
    for round_ in build_gated_delta_plan(packed, final_states_only=True).rounds:
        lengths = (round_.cu_seqlens[1:] - round_.cu_seqlens[:-1]).tolist()
        expected = [(unit, chunk) for unit, length in enumerate(lengths) for chunk in range(-(-length // 64))]
        assert round_.chunk_indices.tolist() == [list(pair) for pair in expected]


def test_bad_shapes():
    packed = PrefixForest.from_sequences([[1, 2, 3]]).pack()
    plan = build_gated_delta_plan(packed)
    q = torch.randn(3, 2, 4)
    with pytest.raises(ValueError, match="multiple of key heads"):
        tree_gated_delta_rule(q, q, torch.randn(3, 3, 4), torch.zeros(3, 3), torch.zeros(3, 3), plan)
    with pytest.raises(ValueError, match="plan covers 3 tokens"):
        tree_gated_delta_rule(q[:2], q[:2], torch.randn(2, 2, 4), torch.zeros(2, 2), torch.zeros(2, 2), plan)
    with pytest.raises(ValueError, match="HQ % HKV"):
        tree_attention(torch.randn(3, 3, 4), torch.randn(3, 2, 4), torch.randn(3, 2, 4), packed.subtree_end)


@pytest.mark.parametrize("chunk_size", [3, 1000])
def test_chunked_logprobs_match_full_softmax(chunk_size):
    from harts_hf.kernels.chunked_logprobs import chunked_logprobs

    torch.manual_seed(0)
    head = torch.nn.Linear(8, 11, bias=True).double()
    hidden = torch.randn(10, 8, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 11, (10,))
    logprobs, entropies = chunked_logprobs(head, hidden, labels, temperature=0.7, chunk_size=chunk_size,
                                           compute_entropy=True)
    log_probs = (head(hidden).float() / 0.7).log_softmax(-1)
    expected = log_probs.gather(-1, labels[:, None])[:, 0]
    expected_entropy = -(log_probs.exp() * log_probs).sum(-1)
    torch.testing.assert_close(logprobs, expected)
    torch.testing.assert_close(entropies, expected_entropy)
    weights = torch.randn(10), torch.randn(10)
    inputs = (hidden, head.weight, head.bias)
    got = torch.autograd.grad((logprobs * weights[0]).sum() + (entropies * weights[1]).sum(), inputs)
    want = torch.autograd.grad((expected * weights[0]).sum() + (expected_entropy * weights[1]).sum(), inputs)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # ZeRO-3's path: the weight read directly instead of one module call per chunk, same values and gradients
    calls = []
    hook = head.register_forward_hook(lambda *_: calls.append(1))
    functional = chunked_logprobs(head, hidden, labels, temperature=0.7, chunk_size=chunk_size, compute_entropy=True,
                                  functional_head=True)
    hook.remove()
    assert not calls
    got = torch.autograd.grad((functional[0] * weights[0]).sum() + (functional[1] * weights[1]).sum(), inputs)
    for a, b in zip((*functional, *got), (logprobs, entropies, *want)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_chunked_logprobs_entropies_without_gradient_leave_nothing_behind():
    """An entropy with gradient that the loss leaves out keeps each chunk's recomputed ``[rows, vocab]`` tensors
    stashed by the checkpoint until the entropies are dropped (the GPU's 37 GiB per 30k-token planner piece);
    ``entropy_grad=False`` computes the same values with no such stash and the same log-prob gradients."""
    import gc

    from harts_hf.kernels.chunked_logprobs import chunked_logprobs

    torch.manual_seed(0)
    rows, vocab = 12, 97
    head = torch.nn.Linear(8, vocab)
    hidden = torch.randn(rows, 8, requires_grad=True)
    labels = torch.randint(0, vocab, (rows,))

    def stashed():  # live tensors shaped like a chunk's logits
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and tuple(o.shape) == (4, vocab))

    results = {}
    for entropy_grad in (True, False):
        logprobs, entropies = chunked_logprobs(head, hidden, labels, chunk_size=4, compute_entropy=True,
                                               entropy_grad=entropy_grad)
        assert entropies.requires_grad == entropy_grad
        grads = torch.autograd.grad(logprobs.sum(), (hidden, head.weight))
        results[entropy_grad] = (logprobs.detach(), entropies.detach(), grads, stashed())
        del logprobs, entropies
    assert results[True][3] > 0 and results[False][3] == 0, (results[True][3], results[False][3])
    for a, b in zip(results[True][:2] + results[True][2], results[False][:2] + results[False][2]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("name", list(FORESTS))
def test_varlen_layout_gives_ancestor_or_self_visibility(name):
    """The varlen path's key rows under bottom-right causal alignment are exactly each token's root path."""
    from harts_hf.kernels import build_varlen_layout

    packed = PrefixForest.from_sequences(FORESTS[name]).pack()
    layout = build_varlen_layout(packed)
    parent = packed.parent.tolist()
    assert layout.cu_q[-1].item() == packed.num_tokens
    for run in range(layout.cu_q.shape[0] - 1):
        queries = range(layout.cu_q[run].item(), layout.cu_q[run + 1].item())
        keys = layout.key_index[layout.cu_k[run]:layout.cu_k[run + 1]].tolist()
        for i, query in enumerate(queries):
            chain, token = [], query
            while token >= 0:
                chain.append(token)
                token = parent[token]
            assert keys[: len(keys) - len(queries) + i + 1] == chain[::-1]


@pytest.mark.parametrize("seed", [0, 1])
def test_round_batch_lays_the_rounds_back_to_back(seed):
    """The round-batched fla node's layout: every round's units in one varlen grid, round after round, with each
    round's own grid recoverable as a slice (what its state pass gets) and every packed token output once."""
    from harts_hf.kernels.tree_gated_delta_rule.round_batch import round_batch

    sequences = random_tree_sequences(random.Random(seed), 12, vocab=5, max_tail=300) + chunk_edge_sequences()
    packed = PrefixForest.from_sequences(sequences).pack()
    plan = build_gated_delta_plan(packed, final_states_only=True)
    assert len(plan.rounds) > 1
    batch = round_batch(plan)
    assert round_batch(plan) is batch  # built once per plan, shared by every layer
    assert torch.equal(batch.token_index, torch.cat([r.token_index for r in plan.rounds]))
    lengths = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).tolist()
    expected_grid = [[unit, c] for unit, n in enumerate(lengths) for c in range(-(-n // plan.chunk_size))]
    assert batch.chunk_indices.tolist() == expected_grid
    unit = 0
    for r, round_ in enumerate(plan.rounds):
        tokens, chunks = batch.tokens[r], batch.chunks[r]
        assert torch.equal(batch.token_index[tokens], round_.token_index)
        units = slice(unit, unit + round_.num_units + 1)
        assert torch.equal(batch.cu_seqlens[units] - tokens.start, round_.cu_seqlens.long())
        assert torch.equal(batch.chunk_indices[chunks] - torch.tensor([unit, 0]), round_.chunk_indices)
        assert torch.equal(batch.round_cu[r], round_.cu_seqlens.long())
        assert torch.equal(batch.round_chunk_indices[r], round_.chunk_indices)
        counts = [-(-n // plan.chunk_size) for n in lengths[unit: unit + round_.num_units]]
        assert batch.round_chunk_offsets[r].tolist() == [sum(counts[:i]) for i in range(len(counts) + 1)]
        unit += round_.num_units
    assert sorted(batch.output_token.tolist()) == list(range(packed.num_tokens))
    assert torch.equal(batch.token_index[batch.output_position], batch.output_token)
    # the same map as gathers: each token's own position, the token each position outputs, the replayed positions
    assert torch.equal(batch.token_index[batch.own_position], torch.arange(packed.num_tokens))
    assert torch.equal(batch.position_token[batch.own_position], torch.arange(packed.num_tokens))
    assert batch.replay_position.numel() == batch.token_index.numel() - packed.num_tokens > 0
    assert torch.equal(batch.replay_token, batch.token_index[batch.replay_position])
    assert not set(batch.replay_position.tolist()) & set(batch.own_position.tolist())
    # sum_by_token: a gather plus the replays' scatter equals the full scatter into zeros (context rows past U too)
    grad = torch.randn(batch.token_index.numel(), 3, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    expected = torch.zeros(packed.num_tokens + 2, 3, dtype=torch.float64).index_add_(0, batch.token_index, grad)
    torch.testing.assert_close(batch.sum_by_token(grad, packed.num_tokens + 2), expected, rtol=0, atol=1e-12)
    # in a low-precision dtype: summed in fp32 at the replayed rows, rounded once (what an fp32 sum then a cast gives)
    assert sorted(set(batch.replay_token.tolist())) == batch.replay_rows.tolist()
    assert torch.equal(batch.replay_rows[batch.replay_slot], batch.replay_token)
    low = grad.to(torch.bfloat16)
    rounded_once = torch.zeros(packed.num_tokens + 2, 3).index_add_(0, batch.token_index, low.float()).bfloat16()
    summed = batch.sum_by_token(low, packed.num_tokens + 2, torch.bfloat16)
    assert summed.dtype == torch.bfloat16 and torch.equal(summed, rounded_once)
    assert batch.sum_by_token(low, packed.num_tokens + 2, torch.float32).dtype == torch.float32
    # the state bank: a unit starts from the row its state was saved in (row 0: zeros, never written)
    row = {}
    for r, round_ in enumerate(plan.rounds):
        assert batch.initial_ids[r].tolist() == [0 if key is None else row[key] for key in round_.initial_state]
        assert batch.save_slots[r].tolist() == [slot for slot, _, _ in round_.saved_states]
        row.update({key: saved for (_, _, key), saved in zip(round_.saved_states, batch.save_ids[r].tolist())})
    assert 0 not in row.values() and len(set(row.values())) == len(row) == batch.num_states - 1
    assert batch.context_id is None
    assert not batch.identity


@pytest.mark.parametrize("handed_in", [False, True])
def test_round_batch_of_unshared_sequences_is_the_identity(handed_in):
    """A forest of unshared sequences (what the packed per-trajectory path runs) executes every token once at its own
    row: the layout's gathers become views, with the same values as the general gathers; a piece whose roots start
    at a chunk boundary from a handed-in state has no replay either. One shared prefix and the layout is no longer
    the identity."""
    from dataclasses import replace

    from harts_hf.kernels.tree_gated_delta_rule.round_batch import round_batch

    rng = random.Random(3)
    sequences = [[10 + i] + [rng.randrange(5) for _ in range(n - 1)] for i, n in enumerate((1, 63, 64, 65, 200))]
    packed = PrefixForest.from_sequences(sequences).pack()
    if handed_in:  # every root at depth 128 below one branch token: chunk-aligned, nothing replayed
        common = [9] * 127
        whole = PrefixForest.from_sequences([common + [7] + s for s in sequences]).pack()
        starts = whole.cu_seqlens[:-1].tolist()
        packed = whole.select([i for i, first in enumerate(starts) if int(whole.position_ids[first]) >= 128])
    plan = build_gated_delta_plan(packed, final_states_only=True)
    batch = round_batch(plan)
    assert batch.identity and torch.equal(batch.token_index, torch.arange(packed.num_tokens))
    general = replace(batch, identity=False)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(packed.num_tokens + 3, 2, 4, generator=generator)[::1]  # 3 context rows past U
    strided = torch.randn(packed.num_tokens, 4, 2, generator=generator).transpose(1, 2)  # not contiguous
    for rows in (x, strided):
        assert torch.equal(batch.executed(rows), general.executed(rows))
        assert batch.executed(rows).is_contiguous()
    o = torch.randn(packed.num_tokens, 2, 4, generator=generator)
    assert torch.equal(batch.own_outputs(o), general.own_outputs(o))
    assert torch.equal(batch.executed_grad(strided), general.executed_grad(strided))
    for dtype in (None, torch.bfloat16, torch.float64):
        assert torch.equal(batch.sum_by_token(o, packed.num_tokens + 3, dtype),
                           general.sum_by_token(o, packed.num_tokens + 3, dtype))
    shared = PrefixForest.from_sequences([sequences[-1] + [1], sequences[-1] + [2]]).pack()
    assert not round_batch(build_gated_delta_plan(shared, final_states_only=True)).identity


@pytest.mark.parametrize("final_states_only", [False, True])
def test_executed_rows_and_the_executed_view(final_states_only):
    """A mixer run whole in its node's executed layout (``gated_deltanet.EXECUTED_LAYOUT``): the conv's ancestor table
    over the executed positions names the right tokens, only a unit's first ``W - 1`` positions reach outside it, the
    gathers' gradients are the scatter's, and the node on the plan's executed view gives every token's output and
    every input gradient of the plan itself (the torch backend, fp64)."""
    from harts_hf.kernels.tree_conv1d.ops import conv_window_fixups
    from harts_hf.kernels.tree_gated_delta_rule.executed import executed_rows

    sequences = random_tree_sequences(random.Random(4), 10, vocab=5, max_tail=200) + chunk_edge_sequences()
    packed = PrefixForest.from_sequences(sequences).pack()
    plan = build_gated_delta_plan(packed, final_states_only=final_states_only)
    rows, view = executed_rows(plan), plan.executed_view()
    assert executed_rows(plan) is rows and plan.executed_view() is view  # built once per plan
    U, E = packed.num_tokens, rows.num_positions
    assert E == view.num_tokens == plan.stats["executed_tokens"] > U and not rows.identity
    assert torch.equal(rows.token_index[rows.own_position], torch.arange(U))
    token_ancestors = packed.ancestor_table(4)
    ancestors = rows.ancestors(token_ancestors)
    reads = torch.where(ancestors >= 0, rows.token_index[ancestors.clamp(min=0)], -1)
    assert torch.equal(reads, token_ancestors[rows.token_index])  # each position's window: its token's ancestors
    units = sum(round_.num_units for round_ in plan.rounds)
    assert 0 < conv_window_fixups(ancestors, 4).numel() <= 3 * units
    # the gathers: the hidden rows' copies summed, the output's own positions only
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(U, 3, dtype=torch.float64, generator=generator, requires_grad=True)
    grad = torch.randn(E, 3, dtype=torch.float64, generator=generator)
    (d_x,) = torch.autograd.grad(rows.to_executed(x), x, grad)
    torch.testing.assert_close(d_x, torch.zeros(U, 3, dtype=torch.float64).index_add_(0, rows.token_index, grad),
                               rtol=0, atol=1e-12)
    y = torch.randn(E, 3, dtype=torch.float64, generator=generator, requires_grad=True)
    (d_y,) = torch.autograd.grad(rows.to_rows(y), y, x.detach())
    assert torch.equal(d_y[rows.own_position], x.detach()) and not d_y[rows.replay_position].any()
    # a forest of unshared sequences (the packed path): nothing gathered either way
    unshared = executed_rows(build_gated_delta_plan(PrefixForest.from_sequences([[1] * 70, [2] * 9]).pack(),
                                                    final_states_only=final_states_only))
    head = x[:79]
    assert unshared.identity and unshared.to_executed(head) is head and unshared.to_rows(head) is head
    # the node on the executed view, fed its executed rows, against the node on the plan
    H, HV, K, V = 1, 2, 8, 8
    inputs = [torch.randn(U, H, K, dtype=torch.float64, generator=generator),
              torch.randn(U, H, K, dtype=torch.float64, generator=generator),
              torch.randn(U, HV, V, dtype=torch.float64, generator=generator),
              -torch.rand(U, HV, dtype=torch.float64, generator=generator) * 0.2,
              torch.rand(U, HV, dtype=torch.float64, generator=generator)]
    inputs = [t.requires_grad_() for t in inputs]
    weight = torch.randn(U, HV, V, dtype=torch.float64, generator=generator)
    want = tree_gated_delta_rule(*inputs, plan, backend="torch", use_qk_l2norm_in_kernel=True)
    got = rows.to_rows(tree_gated_delta_rule(*(rows.to_executed(t) for t in inputs), view, backend="torch",
                                             use_qk_l2norm_in_kernel=True))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    grads = [torch.autograd.grad((out * weight).sum(), inputs) for out in (got, want)]
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_round_batch_reads_a_pieces_context_rows_in_place():
    """A planner piece below a branch point replays context rows: the executed layout gathered from the tokens' rows
    and the context rows apart equals the one gathered from them concatenated, and each row's gradient (its own
    position plus its replays, context rows included) equals a scatter-add over every executed position."""
    from harts_hf.kernels.tree_gated_delta_rule.round_batch import round_batch

    common = [1 + i % 5 for i in range(70)]
    whole = PrefixForest.from_sequences([common + [7] * 80, common + [8] * 9 + [9] * 60, common + [6] * 5]).pack()
    starts = whole.cu_seqlens[:-1].tolist()
    piece = whole.select([s for s, first in enumerate(starts) if int(whole.position_ids[first]) >= 70])
    plan = build_gated_delta_plan(piece, final_states_only=True)
    batch, U, R = round_batch(plan), piece.num_tokens, plan.context_tokens
    assert R == 6 and batch.context_position.numel() >= R and not batch.identity
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(U + R, 2, 4, generator=generator)
    assert torch.equal(batch.executed(rows[:U], rows[U:]), batch.executed(rows))
    grad = torch.randn(batch.token_index.shape[0], 2, 4, dtype=torch.float64, generator=generator)
    want = torch.zeros(U + R, 2, 4, dtype=torch.float64).index_add_(0, batch.token_index, grad)
    for dtype, tolerance in ((None, 1e-12), (torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        got = batch.sum_by_token(grad if dtype is None else grad.to(dtype), U + R, dtype)
        assert got.shape == want.shape and (got.double() - want).abs().max() <= tolerance * want.abs().max()


def test_state_pass_choice(monkeypatch):
    """``STATE_PASS='auto'`` picks the serial pass where the H200 measured it faster (swe, tau at small and full
    size, grpo) and fla's per-round pass on a single sequence (one round: exactly fla's kernel, the per-trajectory
    baseline's) and on a round of many long siblings (the serial chain walks all of them, fla's pass runs them side
    by side); explicit values win; a bad value names the choices."""
    from harts_hf.kernels.tree_gated_delta_rule import fla_backend
    from harts_hf.workloads import make_workload

    def plan_of(name, scale):
        sequences = make_workload(name, scale=scale, seed=0).sequences
        return build_gated_delta_plan(PrefixForest.from_sequences(sequences).pack(), final_states_only=True)

    monkeypatch.setattr(fla_backend, "STATE_PASS", "auto")
    assert fla_backend.STATE_PASS == "auto"
    chosen = {f"{name}@{scale}": fla_backend.state_pass_for(plan_of(name, scale))
              for name, scale in (("swe", 0.02), ("tau", 0.02), ("grpo", 0.05), ("tau", 1.0), ("swe", 1.0))}
    assert set(chosen.values()) == {"serial"}, chosen
    prompt = list(range(1, 301))
    wide = [prompt + [1000 + i] * 4096 for i in range(64)]  # 64 siblings of 64 chunks after one prompt
    assert fla_backend.state_pass_for(build_gated_delta_plan(PrefixForest.from_sequences(wide).pack(),
                                                             final_states_only=True)) == "rounds"
    one = make_workload("swe", scale=0.02, seed=0).sequences[:1]  # one round: fla's own kernel
    assert fla_backend.state_pass_for(build_gated_delta_plan(PrefixForest.from_sequences(one).pack())) == "rounds"
    the_plan = plan_of("grpo", 0.05)
    for value in ("rounds", "serial", "lanes"):
        monkeypatch.setattr(fla_backend, "STATE_PASS", value)
        assert fla_backend.state_pass_for(the_plan) == value
    monkeypatch.setattr(fla_backend, "STATE_PASS", "fast")
    with pytest.raises(ValueError, match="STATE_PASS must be one of"):
        fla_backend.state_pass_for(the_plan)


@pytest.mark.parametrize("seed", [0, 1])
def test_serial_units_follow_the_bank(seed):
    """The serial state pass's unit table (no Triton needed to build it): units in round order, every unit's start
    row saved by an earlier unit (or zeros), chunk offsets matching fla's per-chunk ``h`` layout of the batch."""
    from harts_hf.kernels.tree_gated_delta_rule.round_batch import round_batch
    from harts_hf.kernels.tree_gated_delta_rule.serial_state_pass import serial_units

    sequences = random_tree_sequences(random.Random(seed), 12, vocab=5, max_tail=300) + chunk_edge_sequences()
    plan = build_gated_delta_plan(PrefixForest.from_sequences(sequences).pack(), final_states_only=True)
    batch, units = round_batch(plan), serial_units(plan, "cpu")
    assert serial_units(plan, "cpu") is units
    assert torch.equal(units.bos, batch.cu_seqlens[:-1]) and torch.equal(units.eos, batch.cu_seqlens[1:])
    chunks_per_unit = torch.bincount(batch.chunk_indices[:, 0], minlength=units.num_units)
    assert units.num_chunks == batch.chunk_indices.shape[0]
    assert torch.equal(units.chunk, torch.cumsum(chunks_per_unit, 0) - chunks_per_unit)
    written = {0}
    for i in range(units.num_units):
        assert int(units.initial_row[i]) in written, f"unit {i} starts from a row no earlier unit saved"
        if units.save_row[i] >= 0:
            assert int(units.save_row[i]) not in written  # each row saved once
            written.add(int(units.save_row[i]))
    assert len(written) == batch.num_states


def test_lane_order_walks_heavy_paths_in_waves():
    """Heavy-path lanes on a hand-made unit table: unit 0 (a root) saves row 1; units 1 and 2 start from it; unit 1
    saves row 2, which units 3 and 4 start from; unit 5 starts from a handed-in state (row 7, saved by no unit).
    Heavy children: the longest chain of chunks (0 -> 1 -> 4); lanes of wave 0 are roots, the rest wave 1."""
    from harts_hf.kernels.tree_gated_delta_rule.serial_state_pass import lane_order

    order, lane_start, waves = lane_order([0, 1, 1, 2, 2, 7], [1, 2, -1, -1, -1, -1], [2, 5, 1, 1, 3, 1])
    assert order == [0, 1, 4, 5, 2, 3] and lane_start == [0, 3, 4, 5, 6] and waves == [(0, 2), (2, 4)]
    with pytest.raises(ValueError, match="does not run before it"):
        lane_order([2, 0], [-1, 2], [1, 1])


def test_serial_pass_value_block(monkeypatch):
    """The serial state pass's launch shape: ``VALUE_BLOCK`` columns per program, capped at the value head size
    rounded up (at least 16); other values are refused by name (checked before any launch)."""
    from harts_hf.kernels.tree_gated_delta_rule import serial_state_pass

    assert serial_state_pass.value_block(128) == 32 and serial_state_pass._NUM_WARPS == 4
    monkeypatch.setattr(serial_state_pass, "VALUE_BLOCK", 64)
    assert serial_state_pass.value_block(128) == 64 and serial_state_pass.value_block(24) == 32
    monkeypatch.setattr(serial_state_pass, "VALUE_BLOCK", 16)
    assert serial_state_pass.value_block(8) == 16
    monkeypatch.setattr(serial_state_pass, "VALUE_BLOCK", 48)
    with pytest.raises(ValueError, match="VALUE_BLOCK must be 16, 32 or 64"):
        serial_state_pass.value_block(128)


@pytest.mark.parametrize("seed", [0, 1])
def test_serial_units_in_lanes_keep_every_dependency(seed):
    """``serial_units(plan, lanes=True)``: every unit once; within a lane a unit starts from the state its
    predecessor in the lane saved, a lane's first unit from zeros, a handed-in state or a row saved in an earlier
    wave; the chain per launch (the longest lane of each wave) adds up to no more than the serial pass's."""
    from harts_hf.kernels.tree_gated_delta_rule.serial_state_pass import serial_units

    sequences = random_tree_sequences(random.Random(seed), 12, vocab=5, max_tail=300) + chunk_edge_sequences()
    plan = build_gated_delta_plan(PrefixForest.from_sequences(sequences).pack(), final_states_only=True)
    serial, lanes = serial_units(plan, "cpu"), serial_units(plan, "cpu", lanes=True)
    assert serial_units(plan, "cpu", lanes=True) is lanes and serial.waves == [(0, 1)]
    assert sorted(lanes.bos.tolist()) == sorted(serial.bos.tolist()) and lanes.num_chunks == serial.num_chunks
    chunks = ((lanes.eos - lanes.bos + plan.chunk_size - 1) // plan.chunk_size).tolist()
    start = lanes.lane_start.tolist()
    wave_of = [wave for wave, (first, end) in enumerate(lanes.waves) for lane in range(first, end)
               for _ in range(start[lane], start[lane + 1])]
    saved_in_wave = {int(row): wave_of[position] for position, row in enumerate(lanes.save_row.tolist()) if row > 0}
    for lane in range(len(start) - 1):
        for position in range(start[lane], start[lane + 1]):
            row = int(lanes.initial_row[position])
            if position > start[lane]:
                assert row == int(lanes.save_row[position - 1]) > 0
            else:
                assert row == 0 or saved_in_wave[row] < wave_of[position]
    assert len(lanes.waves) > 1
    longest = sum(max(sum(chunks[start[lane]: start[lane + 1]]) for lane in range(first, end))
                  for first, end in lanes.waves)
    assert longest < sum(chunks)


def _graph_body(x, y, none):
    """A few kernels, an output that is an input, and a None passed through (cuda_graphs.replay_or_run's tests)."""
    return (x * y).cumsum(-1).softmax(-1), x, None if none is None else none + 1


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_cuda_graph_replays_match_eager_runs(device, monkeypatch):
    """replay_or_run on CUDA: per plan and key the first call eager, the second recorded, later ones replayed, each
    on new inputs and each bit for bit the body's own result; above MAX_TOKENS nothing is recorded; beyond MAX_GRAPHS
    live graphs the least recently replayed one is dropped and its plan runs eagerly, still exact. On CPU every call
    runs the body and nothing is recorded (graphs are CUDA-only)."""
    from harts_hf.kernels import cuda_graphs

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("CUDA graphs need a CUDA device (the CPU half of this test runs everywhere)")

    class Plan:
        pass

    def calls(plan, tokens, count, seed=0):
        for call in range(seed, seed + count):
            generator = torch.Generator(device).manual_seed(call)
            x, y = (torch.randn(8, 64, device=device, generator=generator) for _ in range(2))
            got = cuda_graphs.replay_or_run(plan, ("body",), tokens, _graph_body, (x, y, None))
            want = _graph_body(x, y, None)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], x) and got[2] is None

    def recorded(plan):
        return [entry if isinstance(entry, str) else type(entry).__name__
                for entry in plan.__dict__.get("_cuda_graphs", {}).values()]

    monkeypatch.setattr(cuda_graphs, "MAX_TOKENS", 64)
    small, large = Plan(), Plan()
    calls(small, 64, 4)
    calls(large, 65, 4)
    assert (recorded(small), recorded(large)) == ((["_Graph"], []) if device == "cuda" else ([], []))
    monkeypatch.setattr(cuda_graphs, "MAX_GRAPHS", 1)
    first, second = Plan(), Plan()
    calls(first, 64, 3)
    calls(second, 64, 3, seed=3)
    calls(first, 64, 2, seed=6)
    if device == "cuda":
        assert (recorded(first), recorded(second)) == (["eager"], ["_Graph"])


def test_cuda_graph_settings_are_checked(monkeypatch):
    """A bad MAX_TOKENS is named with its value and what 0 means, on any device."""
    from harts_hf.kernels import cuda_graphs

    for bad, error in ((-1, ValueError), ("8192", TypeError)):
        monkeypatch.setattr(cuda_graphs, "MAX_TOKENS", bad)
        with pytest.raises(error, match=r"cuda_graphs.MAX_TOKENS \(0 turns graphs off\) must be an integer >= 0"):
            cuda_graphs.replay_or_run(object(), ("body",), 8, _graph_body, (torch.ones(2), torch.ones(2), None))


@pytest.mark.parametrize("name", list(FORESTS) + ["two_trees"])
@pytest.mark.parametrize("context", [0, 5, 130])
def test_flex_attention_block_mask_and_forward_match_the_tree_mask(name, context):
    """FlexAttention on the packed rows (:mod:`.flex`): its block tables hold every visible (query, key) pair of
    ``k <= q < subtree_end[k]`` (context keys: every query) in a listed block, only visible pairs in the blocks marked
    full (FlexAttention skips the mask there), and the per-key intervals equal the tree mask on every pair; the
    forward (FlexAttention's eager reference on the CPU, which has no FlexAttention backward) equals the dense-mask
    path in fp64, values narrower than keys. Its gradients are FlexAttention's own backward on these blocks, checked
    against the varlen path on the GPU (benchmarks/attention_kernels.py --forest)."""
    from harts_hf.kernels.tree_attention import flex
    from harts_hf.kernels.tree_attention.ops import tree_attention_mask

    sequences = FORESTS["fan_out"] + FORESTS["random_a"] if name == "two_trees" else FORESTS[name]
    packed = PrefixForest.from_sequences(sequences).pack()
    U, HQ, HKV, D, DV = packed.num_tokens, 4, 2, 8, 6
    tables = flex.flex_block_tables(packed.subtree_end, context)
    rows, keys, block = tables["rows"], tables["keys"], flex.BLOCK
    assert rows % block == 0 and keys % block == 0 and rows >= U and keys - rows >= context
    query, key = torch.arange(rows)[:, None], torch.arange(keys)[None, :]
    visible = (tables["start"].long()[key] <= query) & (query < tables["end"].long()[key])
    tree_mask = tree_attention_mask(packed.subtree_end, context)
    assert torch.equal(visible[:U, :U], tree_mask[:, :U])
    assert torch.equal(visible[:U, rows: rows + context], tree_mask[:, U:])
    assert not visible[:U, U:rows].any() and not visible[:, rows + context:].any()

    def dense(num, indices):
        out = torch.zeros(rows // block, keys // block, dtype=torch.bool)
        for i in range(rows // block):
            out[i, indices[0, 0, i, : num[0, 0, i]].long()] = True
        return out

    partial = dense(tables["kv_num_blocks"], tables["kv_indices"])
    full = dense(tables["full_kv_num_blocks"], tables["full_kv_indices"])
    tiles = visible.view(rows // block, block, keys // block, block)
    assert not (partial & full).any()
    assert not (tiles.any(3).any(1) & ~(partial | full)).any()  # every visible pair in a listed block
    assert tiles.all(3).all(1)[full].all()  # full blocks: every pair visible
    torch.manual_seed(0)
    q, k = torch.randn(U, HQ, D, dtype=torch.float64), torch.randn(U, HKV, D, dtype=torch.float64)
    v = torch.randn(U, HKV, DV, dtype=torch.float64)
    ck, cv = torch.randn(context, HKV, D, dtype=torch.float64), torch.randn(context, HKV, DV, dtype=torch.float64)
    out = flex.tree_attention_flex(q, torch.cat([k, ck]), torch.cat([v, cv]), packed.subtree_end, context, scaling=0.3,
                                   tables=tables)
    pad = lambda x: torch.cat([x, x.new_zeros(*x.shape[:2], D - DV)], dim=-1)  # noqa: E731  (one head dim)
    expected = tree_attention(q, k, pad(v), packed.subtree_end, scaling=0.3, backend="sdpa",
                              **(dict(context_k=ck, context_v=pad(cv)) if context else {}))[..., :DV]
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float64])


def test_flex_kernel_routes_only_forests_whose_runs_gather_keys(monkeypatch):
    """``varlen.KERNEL = "flex"`` sends the varlen path to FlexAttention where the runs would gather key rows beyond
    their own (shared prefixes, context rows), and leaves a forest of separate sequences (the packed per-trajectory
    path) on torch's flash varlen; the trainers' ``tree_varlen_kernel`` takes ``"flex"``."""
    from harts_hf.kernels.tree_attention import ops, varlen
    from harts_hf.trainers.config import _VARLEN_KERNELS

    monkeypatch.setattr(varlen, "KERNEL", "flex")
    shared = PrefixForest.from_sequences([[1, 2, 3, 4], [1, 2, 5]]).pack()
    separate = PrefixForest.from_sequences([[1, 2, 3, 4], [6, 2, 5]]).pack()
    q = lambda packed: torch.zeros(packed.num_tokens, 2, 4)  # noqa: E731
    assert ops._flex_varlen(q(shared), build_varlen_layout(shared))
    assert not ops._flex_varlen(q(separate), build_varlen_layout(separate))
    assert ops._flex_varlen(q(separate), build_varlen_layout(separate, context_tokens=3))
    monkeypatch.setattr(varlen, "KERNEL", "torch")
    assert not ops._flex_varlen(q(shared), build_varlen_layout(shared))
    assert "flex" in _VARLEN_KERNELS


def test_flex_attention_compiles_once_across_forest_sizes_and_autocast_states():
    """FlexAttention's compiled call (here inductor's CPU code, forward only: the CPU has no FlexAttention backward)
    equals its eager reference and compiles ONE graph for forests of six sizes under autocast on and off (autocast is a
    guard: the forward under it against a rerun without it recompiled to dynamo's limit on the GPU, 2026-12-06)."""
    import warnings

    from torch._dynamo.utils import counters

    from harts_hf.kernels.tree_attention import flex

    rng = random.Random(3)
    base = [rng.randrange(50) for _ in range(300)]
    cases = []
    for i in range(6):
        packed = PrefixForest.from_sequences([base[: rng.choice([0, 64, 129, 256])] + [rng.randrange(50) for _ in range(
            rng.randrange(1, 100 + 150 * i))] for _ in range(8)]).pack()
        U = packed.num_tokens
        inputs = (torch.randn(U, 4, 32, dtype=torch.bfloat16), torch.randn(U, 2, 32, dtype=torch.bfloat16),
                  torch.randn(U, 2, 16, dtype=torch.bfloat16), packed.subtree_end)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cases.append((inputs, flex.tree_attention_flex(*inputs, compiled=False)))  # (eager compiles too)
    torch._dynamo.reset()
    counters.clear()
    for i, (inputs, expected) in enumerate(cases):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=i % 2 == 0), torch.no_grad():
            out = flex.tree_attention_flex(*inputs, compiled=True)
        torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_flex_attention_at_the_recompile_limit_raises_naming_the_switch():
    """Past torch.compile's recompile limit FlexAttention would run its dense reference (a [heads, U, U] score matrix:
    564 GiB asked for on full-size `tau`, 2026-12-06): the call raises instead, naming ``tree_varlen_kernel``."""
    from harts_hf.kernels.tree_attention import flex

    packed = PrefixForest.from_sequences(FORESTS["random_a"]).pack()
    U = packed.num_tokens
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=1), torch.no_grad():
        for dtype in (torch.bfloat16, torch.float32):  # a dtype is a guard: the second call recompiles
            inputs = [torch.randn(U, 2, 16, dtype=dtype) for _ in range(3)]
            if dtype == torch.bfloat16:
                flex.tree_attention_flex(*inputs, packed.subtree_end, compiled=True)
                continue
            with pytest.raises(RuntimeError, match="tree_varlen_kernel='torch'"):
                flex.tree_attention_flex(*inputs, packed.subtree_end, compiled=True)
    torch._dynamo.reset()


def test_gather_sum_setting(monkeypatch):
    """``varlen.GATHER_SUM``: a bad value raises naming it; ``"rows"`` (the Triton kernel on CUDA, checked under
    Triton's interpreter in scripts/check_fla_nodes_on_cpu.py) gives CPU tensors the fp32 ``index_add`` sums, rounded
    once, as the default does; the kernel's lists of each row's copies are right and kept per index tensor (listed
    again for another row count or after an in-place change)."""
    from harts_hf.kernels.tree_attention import varlen

    index = torch.tensor([0, 2, 0, 0, 3])
    grad = torch.randn(5, 2, 3, dtype=torch.bfloat16)
    expected = torch.zeros(5, 2, 3).index_add_(0, index, grad.float()).bfloat16()
    for setting in ("index_add", "rows"):
        monkeypatch.setattr(varlen, "GATHER_SUM", setting)
        torch.testing.assert_close(varlen.sum_gathered_rows(grad, index, 5, torch.bfloat16), expected, rtol=0, atol=0)
    order, offsets = varlen._copies_of_rows(index, 5)  # the kernel's lists of copies, kept per index tensor
    assert order.tolist() == [0, 2, 3, 1, 4] and offsets.tolist() == [0, 3, 3, 4, 5, 5]
    assert varlen._copies_of_rows(index, 5)[0] is order and varlen._copies_of_rows(index, 6)[0] is not order
    index[1] = 3  # changed in place: listed again
    assert varlen._copies_of_rows(index, 6)[1].tolist() == [0, 3, 3, 3, 5, 5, 5]
    monkeypatch.setattr(varlen, "GATHER_SUM", "atomic")
    with pytest.raises(ValueError, match="GATHER_SUM must be 'index_add' or 'rows', got 'atomic'"):
        varlen.sum_gathered_rows(grad, index, 5, torch.bfloat16)
