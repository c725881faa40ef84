"""Tree kernels on the GPU: correctness of the fused fla backend and the per-op breakdown against plain calls.

    python benchmarks/gpu_kernels.py --out results/          # on the H200 (see ../shared/device/README.md)

1. Parity (bf16 inputs): tree gated delta rule with the fused fla node, the round-batched node
   (``fla_backend.BATCH_ROUNDS``; with fla's state pass per round and with the serial one, ``STATE_PASS``) and fla's public function once per round vs the fp32 torch backend; outputs and
   every input gradient. Hand-off pieces (handed-in state, context rows, requested states) on both nodes, and fla's
   own bf16 level for gradients through final states (its public function, loss on outputs and final states).
2. Timing (fwd+bwd, warm, CUDA-synchronised) at the ~2B Qwen3-Next layer shapes on a workload's forest:
   - gated delta rule: the tree node as the model runs it (``STATE_PASS="auto"``), with each state pass (fla's per
     round, the serial one, the serial one on heavy-path lanes), the per-round autograd version, and ONE varlen fla
     call over the same unique tokens (the tree's runs as independent sequences, no hand-over): the target is
     tree <= 1.15x that call; ``--serial-blocks 16 64`` adds the serial pass at other value blocks;
   - attention: the varlen tree path and cuDNN per run (exact shapes, and bucketed: ``CUDNN_KEY_BLOCK = 4096``,
     each with its first call, which builds cuDNN's plans) vs SDPA causal on one plain sequence and vs the
     trajectories' own flash varlen, in attended pairs per second (target >= 0.8x); ``swe:1.0 swe:1.0:1`` shows what
     a second forest of the same preset costs on its first call;
   - tree conv1d (ancestor gather) vs a plain depthwise conv over the same number of tokens.
Writes <out>/gpu_kernels.json and prints a table.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import time
from pathlib import Path

import numpy as np
import torch

SERIAL_BLOCKS: list[int] = []  # value blocks of the serial state pass to time (--serial-blocks)


def bench(function, repeats: int = 5) -> float:
    """Mean seconds of ``function()`` after one warm-up call (CUDA-synchronised where CUDA is in use)."""
    synchronize = torch.cuda.synchronize if torch.cuda.is_initialized() else (lambda: None)
    function()
    synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        function()
    synchronize()
    return (time.perf_counter() - start) / repeats


def rel(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def gdn_inputs(U, HK, HV, K, V, seed=0):
    torch.manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    q, k, v = make(U, HK, K), make(U, HK, K), make(U, HV, V)
    g = -torch.rand(U, HV, device="cuda") * 0.2
    beta = torch.rand(U, HV, device="cuda", dtype=torch.bfloat16)
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def batched_rounds(run, batched: bool = True, state_pass: str = "rounds"):
    """``run()`` with ``fla_backend.BATCH_ROUNDS = batched`` (round-batched node or the fused per-round node) and
    the round-batched node's ``fla_backend.STATE_PASS`` ("rounds", "serial" or "lanes"), restoring both switches."""
    from harts_hf.kernels.tree_gated_delta_rule import fla_backend

    previous = fla_backend.BATCH_ROUNDS, fla_backend.STATE_PASS
    fla_backend.BATCH_ROUNDS, fla_backend.STATE_PASS = batched, state_pass
    try:
        return run()
    finally:
        fla_backend.BATCH_ROUNDS, fla_backend.STATE_PASS = previous


def final_state_parity(results: dict) -> None:
    """fla's own bf16 level for gradients through final states: its public function on forked-free random
    sequences with ``output_final_state=True`` and a loss on outputs AND final states, against fp32 torch."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    from harts_hf.kernels.tree_gated_delta_rule.chunked import prepare_inputs

    def recurrent(q, k, v, g, beta):  # fp32, one token at a time; output and final state
        q, k, v, g, beta = prepare_inputs(q, k, v, g, beta, None, True)
        state, outputs = q.new_zeros(k.shape[1], k.shape[2], v.shape[-1]), []
        for t in range(k.shape[0]):
            state = state * g[t].exp()[:, None, None]
            delta = (v[t] - torch.einsum("hkv,hk->hv", state, k[t])) * beta[t][:, None]
            state = state + k[t][:, :, None] * delta[:, None, :]
            outputs.append(torch.einsum("hkv,hk->hv", state, q[t]))
        return torch.stack(outputs), state

    lengths = [20, 128, 141, 210, 140, 128]
    inputs = gdn_inputs(sum(lengths), 4, 8, 128, 128)
    cu = torch.tensor([0, *np.cumsum(lengths)], device="cuda")
    report = {}
    out, final = chunk_gated_delta_rule(*(x.unsqueeze(0) for x in inputs), cu_seqlens=cu, output_final_state=True,
                                        use_qk_l2norm_in_kernel=True)
    loss = out.float().square().sum() + final.square().sum()
    grads = torch.autograd.grad(loss, inputs)
    ref_loss = 0
    for i in range(len(lengths)):
        part = [x[cu[i]:cu[i + 1]].float() for x in inputs]
        o, state = recurrent(*part)
        ref_loss = ref_loss + o.square().sum() + state.square().sum()
    ref = torch.autograd.grad(ref_loss, inputs)
    for j, arg in enumerate("q k v g beta".split()):
        report[f"grad_{arg}"] = rel(grads[j], ref[j])
    results["final_state_parity_vs_fp32"] = report


def parity(results: dict) -> None:
    from harts_hf.kernels import build_gated_delta_plan, tree_gated_delta_rule
    from harts_hf.kernels.tree_gated_delta_rule.fla_backend import (
        tree_gated_delta_rule_fla,
        tree_gated_delta_rule_fla_autograd,
    )
    from harts_hf.trees import PrefixForest
    from tests.forests import random_tree_sequences

    sequences = random_tree_sequences(random.Random(0), 24, vocab=7, max_tail=700)
    packed = PrefixForest.from_sequences(sequences).pack()
    inputs = gdn_inputs(packed.num_tokens, 4, 8, 128, 128)
    weight = torch.randn_like(inputs[2], dtype=torch.float32)
    fla_plan = build_gated_delta_plan(packed, final_states_only=True).to("cuda")
    torch_plan = build_gated_delta_plan(packed).to("cuda")
    outs = {}
    for name, run in (
        ("fused", lambda: batched_rounds(lambda: tree_gated_delta_rule_fla(
            *inputs, fla_plan, scale=128 ** -0.5, use_qk_l2norm_in_kernel=True), batched=False)),
        ("batched", lambda: batched_rounds(lambda: tree_gated_delta_rule_fla(
            *inputs, fla_plan, scale=128 ** -0.5, use_qk_l2norm_in_kernel=True))),
        ("serial", lambda: batched_rounds(lambda: tree_gated_delta_rule_fla(
            *inputs, fla_plan, scale=128 ** -0.5, use_qk_l2norm_in_kernel=True), state_pass="serial")),
        ("per_round", lambda: tree_gated_delta_rule_fla_autograd(*inputs, fla_plan, scale=128 ** -0.5,
                                                                 use_qk_l2norm_in_kernel=True)),
        ("torch_fp32", lambda: tree_gated_delta_rule(*(x.float() for x in inputs), torch_plan,
                                                     use_qk_l2norm_in_kernel=True, backend="torch")),
    ):
        out = run()
        outs[name] = (out.detach(), torch.autograd.grad((out.float() * weight).sum(), inputs))
    report = {"plan": fla_plan.stats}
    for name in ("fused", "per_round", "batched", "serial"):
        report[f"{name}_vs_fp32_out"] = rel(outs[name][0], outs["torch_fp32"][0])
        for j, arg in enumerate("q k v g beta".split()):
            report[f"{name}_vs_fp32_grad_{arg}"] = rel(outs[name][1][j], outs["torch_fp32"][1][j])
    for other in ("per_round", "batched", "serial"):
        report[f"fused_vs_{other}_out"] = rel(outs["fused"][0], outs[other][0])
        for j, arg in enumerate("q k v g beta".split()):
            report[f"fused_vs_{other}_grad_{arg}"] = rel(outs["fused"][1][j], outs[other][1][j])
    results["parity"] = report


def handoff_parity(results: dict) -> None:
    """Planner pieces on the fla node (context rows, handed-in state, requested states) vs the fp32 torch backend
    on the same piece, and vs the whole forest: outputs and gradients, including the handed-in state's."""
    from harts_hf.kernels import build_gated_delta_plan, tree_gated_delta_rule
    from harts_hf.planner import plan
    from tests.test_handoff import _root_path, handoff_sequences

    the_plan = plan(handoff_sequences(seed=3), token_budget=140)
    packed = the_plan.packed
    inputs = gdn_inputs(packed.num_tokens, 4, 8, 128, 128)
    cu = packed.cu_seqlens.tolist()
    report = {}
    for piece in the_plan.pieces:
        if piece.handoff is None:
            continue
        tokens = torch.cat([torch.arange(cu[s], cu[s + 1]) for s in piece.segments]).cuda()
        sub = packed.select(piece.segments)
        d0 = int(packed.position_ids[tokens[0]])
        ancestors = _root_path(packed, int(tokens[0])).cuda()
        boundary = 64 * (d0 // 64)
        children = [p for p in the_plan.pieces if p.handoff is not None and p.handoff.source_piece == piece.index]
        branches = [int(torch.searchsorted(tokens.cpu(), child.handoff.branch_token)) for child in children]
        state = torch.randn(8, 128, 128, device="cuda").mul_(0.1).requires_grad_() if boundary else None
        outs = {}
        for name in ("fla", "fla_batched", "fla_serial", "torch"):
            backend = "torch" if name == "torch" else "fla"
            cast = (lambda x: x) if backend == "fla" else (lambda x: x.float())
            sub_plan = build_gated_delta_plan(sub, final_states_only=backend == "fla", state_requests=branches).to("cuda")
            context = tuple(cast(t[ancestors[boundary:]]) for t in inputs) if d0 > boundary else None
            run = functools.partial(tree_gated_delta_rule, *(cast(t[tokens]) for t in inputs), sub_plan,
                                    backend=backend, use_qk_l2norm_in_kernel=True, initial_state=state,
                                    context=context, output_requested_states=True)
            out, states = batched_rounds(run, batched=name != "fla",
                                         state_pass="serial" if name == "fla_serial" else "rounds")
            loss = out.float().square().sum() + sum(s.square().sum() for s in states if s is not None)
            leaves = [*inputs, *([state] if state is not None else [])]
            outs[name] = (out.detach(), [s.detach() for s in states if s is not None],
                          torch.autograd.grad(loss, leaves))
        entry = {}
        for name, against, node in (("", "torch", "fla"), ("batched_", "torch", "fla_batched"),
                                    ("batched_vs_fused_", "fla", "fla_batched"), ("serial_", "torch", "fla_serial"),
                                    ("serial_vs_fused_", "fla", "fla_serial")):
            mine = outs[node]
            entry[f"{name}out"] = rel(mine[0], outs[against][0])
            entry[f"{name}states"] = max([rel(a, b) for a, b in zip(mine[1], outs[against][1])], default=0.0)
            entry[f"{name}grads"] = max(rel(a, b) for a, b in zip(mine[2], outs[against][2]))
        report[f"piece{piece.index}_d0_{d0}"] = entry
    results["handoff_parity_vs_fp32"] = report


def graphs(run, max_tokens: int = 1 << 30):
    """``run()`` with the tree nodes' CUDA graphs on plans of up to ``max_tokens`` rows
    (``cuda_graphs.MAX_TOKENS``; 0: every call eager)."""
    from harts_hf.kernels import cuda_graphs

    previous, cuda_graphs.MAX_TOKENS = cuda_graphs.MAX_TOKENS, max_tokens
    try:
        return run()
    finally:
        cuda_graphs.MAX_TOKENS = previous


def _node_outputs_and_grads(args, options, node_plan, weight, leaves) -> list:
    """The fla GDN node on ``args``: its output, requested states and the gradients of ``leaves``."""
    from harts_hf.kernels import tree_gated_delta_rule

    out, states = tree_gated_delta_rule(*args, node_plan, backend="fla", use_qk_l2norm_in_kernel=True,
                                        output_requested_states=True, **options)
    loss = (out.float() * weight).sum() + sum(s.square().sum() for s in states if s is not None)
    return [out, *(s for s in states if s is not None), *torch.autograd.grad(loss, leaves, retain_graph=True)]


def graph_parity(results: dict) -> None:
    """The GDN node through its CUDA graphs (per plan: first call eager, second recorded, later ones replayed)
    against the eager node, on new inputs at every call: outputs, requested states and every gradient compared bit
    for bit, on a whole forest and on planner pieces (handed-in state, context rows, requested states), with both
    state passes. Two eager runs are compared too (what bit-identical can mean here)."""
    from harts_hf.kernels import build_gated_delta_plan, cuda_graphs
    from harts_hf.planner import plan
    from harts_hf.trees import PrefixForest
    from tests.forests import random_tree_sequences
    from tests.test_handoff import _root_path, handoff_sequences

    cases = {}
    packed = PrefixForest.from_sequences(random_tree_sequences(random.Random(1), 24, vocab=7, max_tail=700)).pack()
    heads = (16, 32, 128, 128)  # the 2B preset's key / value heads and dims (kernels a model run compiled already)
    cases["forest"] = (packed, lambda seed: (gdn_inputs(packed.num_tokens, *heads, seed), {}, []), [])
    the_plan = plan(handoff_sequences(seed=3), token_budget=140)
    whole, cu = the_plan.packed, the_plan.packed.cu_seqlens.tolist()
    for piece in the_plan.pieces:
        if piece.handoff is None:
            continue
        tokens = torch.cat([torch.arange(cu[s], cu[s + 1]) for s in piece.segments]).cuda()
        d0 = int(whole.position_ids[tokens[0]])
        ancestors, boundary = _root_path(whole, int(tokens[0])).cuda(), 64 * (d0 // 64)
        children = [p for p in the_plan.pieces if p.handoff is not None and p.handoff.source_piece == piece.index]
        branches = [int(torch.searchsorted(tokens.cpu(), child.handoff.branch_token)) for child in children]

        def make(seed, tokens=tokens, ancestors=ancestors, boundary=boundary, d0=d0):
            inputs = gdn_inputs(whole.num_tokens, *heads, seed)
            state = torch.randn(*heads[1:], device="cuda").mul_(0.1).requires_grad_() if boundary else None
            context = tuple(t[ancestors[boundary:]] for t in inputs) if d0 > boundary else None
            return [t[tokens] for t in inputs], dict(initial_state=state, context=context), \
                [*inputs, *([state] if state is not None else [])]

        cases[f"piece{piece.index}_d0_{d0}"] = (whole.select(piece.segments), make, branches)
    report = {}
    for name, (forest, make, branches) in cases.items():
        for state_pass in ("serial", "rounds"):
            node_plan = build_gated_delta_plan(forest, final_states_only=True, state_requests=branches).to("cuda")
            entry = {"identical": True, "eager_repeat_identical": True, "max_abs_diff": 0.0}
            for call in range(4):
                args, options, leaves = make(call)
                leaves = leaves or args
                weight = torch.randn(args[2].shape, device="cuda", generator=torch.Generator("cuda").manual_seed(call))

                run = functools.partial(_node_outputs_and_grads, args, options, node_plan, weight, leaves)
                eager = graphs(functools.partial(batched_rounds, run, state_pass=state_pass), 0)
                again = graphs(functools.partial(batched_rounds, run, state_pass=state_pass), 0)
                graphed = graphs(functools.partial(batched_rounds, run, state_pass=state_pass))
                entry["eager_repeat_identical"] &= all(torch.equal(a, b) for a, b in zip(eager, again))
                entry["identical"] &= all(torch.equal(a, b) for a, b in zip(eager, graphed))
                entry["max_abs_diff"] = max(entry["max_abs_diff"], *((a.float() - b.float()).abs().max().item()
                                                                     for a, b in zip(eager, graphed)))
            entry["graphs"] = sum(isinstance(v, cuda_graphs._Graph)
                                  for v in node_plan.__dict__.get("_cuda_graphs", {}).values())
            report[f"{name}/{state_pass}"] = entry
    results["graph_parity"] = report
    print(json.dumps(report, indent=1), flush=True)


def kernel_breakdown(function, top: int = 12, label: str = "kernels") -> list:
    """Device time of ``function()`` by kernel (torch.profiler, one warm call): ``[(name, seconds, calls)]``, also
    printed under ``label``."""
    from torch.profiler import ProfilerActivity, profile

    function()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        function()
        torch.cuda.synchronize()
    rows = [(e.key[:90], e.self_device_time_total / 1e6, e.count) for e in prof.key_averages()
            if e.self_device_time_total > 0]
    rows = sorted(rows, key=lambda r: -r[1])[:top]
    print(f"    {label}:", flush=True)
    for name, seconds, calls in rows:
        print(f"    {seconds * 1e3:8.2f} ms {calls:4d}x {name}", flush=True)
    return rows


def path_attention(make, sequences, max_tokens: int, backward) -> dict:
    """The per-trajectory baseline's attention on the same kernel: flash varlen, causal, the workload's own
    trajectories packed (unpadded) up to ``max_tokens`` path tokens and what one call can address
    (``varlen.varlen_call_groups``); returns seconds, pairs and the pair rate."""
    from torch.nn.attention.varlen import varlen_attn

    from harts_hf.kernels.tree_attention.varlen import gqa_keyword, varlen_call_groups

    lengths = []  # what ONE call addresses: past it torch's kernel overflows (the tree path splits, this baseline stops)
    for sequence in sorted(sequences, key=len):
        offsets = [0] + np.cumsum(lengths + [len(sequence)]).tolist()
        if lengths and (offsets[-1] > max_tokens or len(varlen_call_groups(offsets, offsets, 16 * 256, 2 * 256)) > 1):
            break
        lengths.append(len(sequence))
    cu = torch.tensor([0] + np.cumsum(lengths).tolist(), dtype=torch.int32, device="cuda")
    T = int(cu[-1])
    q, k, v = make(T, 16, 256), make(T, 2, 256), make(T, 2, 256)
    seconds = bench(lambda: backward(varlen_attn(q, k, v, cu, cu, max(lengths), max(lengths), window_size=(-1, 0),
                                                 **gqa_keyword(varlen_attn))))
    pairs = sum(n * (n + 1) / 2 for n in lengths)
    return dict(seconds=seconds, pairs=pairs, trajectories=len(lengths), tokens=T, pairs_per_s=pairs / seconds)


def timing(results: dict, workload: str, scale: float, ops=("gdn", "attention", "conv"),
           profile: bool = False, seed: int = 0) -> None:
    from harts_hf.kernels import TreeMetadata
    from harts_hf.trees import PrefixForest
    from harts_hf.workloads import make_workload

    sequences = make_workload(workload, scale=scale, seed=seed).sequences
    forest = PrefixForest.from_sequences(sequences)
    packed = forest.pack()
    start = time.perf_counter()
    tree = TreeMetadata(packed, "cuda", gdn_backend="fla", attention_backend="varlen")
    plan, layout = tree.gdn_plan("fla"), tree.varlen_layout()
    ancestors = tree.ancestors(4)
    torch.cuda.synchronize()
    host_seconds = time.perf_counter() - start
    stats = tree.stats()
    U = packed.num_tokens
    row = {"stats": stats, "metadata_seconds": host_seconds}
    key = f"{workload}@{scale}" + (f"/seed{seed}" if seed else "")
    results.setdefault("timing", {})[key] = row  # filled in place: a failing op keeps the rest

    def backward(out):
        out.float().square().mean().backward()

    if "gdn" in ops:
        gdn_timing(row, packed, plan, U, backward, profile)
    if "attention" in ops:
        attention_timing(row, packed, layout, stats, sequences, backward, profile)
    if "conv" in ops:
        conv_timing(row, U, ancestors, backward)
    if "varlen_kernels" in ops:
        varlen_kernel_timing(row, packed, layout, stats, backward)
    if "attention_features" in ops:
        attention_features(row, sequences)


ATTENTION_FEATURES = {  # name: (query heads, key/value heads, q/k head dim, v head dim, tree_attention options)
    "window 256 (16/2 heads of 256)": (16, 2, 256, 256, dict(window=256)),
    "latent attention (32 heads, q/k 192, v 128)": (32, 32, 192, 128, {}),
    "softcap 50 (8/4 heads of 256)": (8, 4, 256, 256, dict(softcap=50.0)),
    "sinks (64/8 heads of 64)": (64, 8, 64, 64, dict(sinks=True)),
}
"""The attention features of issue 24's families at their models' head shapes: Gemma / Mistral / GPT-OSS sliding
windows, DeepSeek / Kimi / Ling latent attention (v narrower than q/k), Gemma 2 logit softcapping, GPT-OSS sinks."""


def attention_features(row: dict, sequences, device="cuda", features=None, timing: bool = True) -> None:
    """Each attention feature on the forest of ``sequences``: the tree (``tree_attention``'s ``auto`` backend in
    bf16) and the per-trajectory path (the same kernel on every trajectory as its own tree, no sharing) against
    the fp32 per-run path on the tree, output and every input gradient (relative Frobenius error; the loss weighs
    each token by its multiplicity, as the trajectories' summed losses do), and each path's fwd+bwd seconds."""
    from harts_hf.kernels import build_varlen_layout
    from harts_hf.trees import PrefixForest

    tree = PrefixForest.from_sequences(sequences).pack()
    alone = PrefixForest.from_sequences(sequences, groups=list(range(len(sequences)))).pack()
    source = torch.empty(alone.num_tokens, dtype=torch.long)
    source[alone.sequence_token_index] = tree.sequence_token_index  # a trajectory's token -> its tree token
    forests = {"tree": (tree, build_varlen_layout(tree).to(device), None),
               "per_trajectory": (alone, build_varlen_layout(alone).to(device), source.to(device))}
    half = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    for name, shape in (features or ATTENTION_FEATURES).items():
        entry = row.setdefault("attention_features", {}).setdefault(name, {})
        _attention_feature(entry, forests, shape, device, half, timing)
        print(f"  {name}: " + "; ".join(f"{path} {entry.get(f'{path}_s', float('nan')) * 1e3:.1f} ms, error vs fp32 "
                                       + ", ".join(f"{e:.1e}" for e in entry[f"{path}_error_vs_fp32"].values())
                                       for path in forests), flush=True)


def _attention_feature(entry: dict, forests: dict, shape: tuple, device, half, timing: bool) -> None:
    """One row of :func:`attention_features` into ``entry``."""
    from harts_hf.kernels import tree_attention

    HQ, HKV, D, DV, options = shape
    tree = forests["tree"][0]
    generator = torch.Generator(device=device).manual_seed(0)

    def make(*size):
        return torch.randn(*size, device=device, generator=generator)

    leaves = [make(tree.num_tokens, HQ, D), make(tree.num_tokens, HKV, D), make(tree.num_tokens, HKV, DV)]
    multiplicity = tree.multiplicity.to(device)
    weight = make(tree.num_tokens, HQ, DV) * multiplicity[:, None, None]
    kwargs = dict(options)
    sinks = make(HQ) if kwargs.pop("sinks", False) else None  # a parameter: fp32 under autocast, as in a model
    names = ("out", "dq", "dk", "dv") + (() if sinks is None else ("dsinks",))

    def call(path, inputs, backend="auto"):  # inputs and output on the path's forest's tokens
        packed, layout, _ = forests[path]
        q, k, v, *rest = inputs
        return tree_attention(q, k, v, packed.subtree_end.to(device), backend=backend, layout=layout,
                              depth=packed.position_ids.to(device), sinks=rest[0] if rest else None, **kwargs)

    def inputs_of(path, dtype):
        index = forests[path][2]
        tokens = [(x if index is None else x[index]).detach().to(dtype).requires_grad_() for x in leaves]
        return tokens + ([] if sinks is None else [sinks.detach().clone().requires_grad_()])

    def run(path, dtype, backend="auto"):
        """Output, and the gradients of the inputs on the tree's tokens: a trajectory's copies are inputs of their
        own, their gradients summed in fp32 (as a model's weight gradients sum over every position)."""
        index = forests[path][2]
        inputs = inputs_of(path, dtype)
        out = call(path, inputs, backend)
        token_weight = weight if index is None else weight[index] / multiplicity[index][:, None, None]
        grads = list(torch.autograd.grad((out.float() * token_weight).sum(), inputs))
        if index is not None:
            grads[:3] = [torch.zeros_like(x).index_add_(0, index, g.float()) for x, g in zip(leaves, grads)]
        return [out.detach()] + grads

    reference = run("tree", torch.float32, backend="runs")
    for path in forests:
        result = run(path, half)
        index = forests[path][2]
        expected = [reference[0] if index is None else reference[0][index]] + reference[1:]
        entry[f"{path}_error_vs_fp32"] = dict(zip(names, map(rel, result, expected)))
        if timing:
            inputs = inputs_of(path, half)
            entry[f"{path}_s"] = bench(lambda path=path, inputs=inputs: call(path, inputs).float().square()
                                       .mean().backward())


def varlen_kernel_timing(row, packed, layout, stats, backward) -> None:
    """The tree's varlen attention (16 / 2 heads of 256) on each varlen kernel (``varlen.KERNEL``: torch's flash,
    FlashAttention-4): first call (compilation) and warm fwd+bwd, pairs per second, and the bf16 error of each
    against the fp32 per-run SDPA path (forests of <= 20k tokens) or against torch's kernel."""
    from harts_hf.kernels import tree_attention
    from harts_hf.kernels.tree_attention import varlen

    U = packed.num_tokens
    torch.manual_seed(0)
    q, k, v = (torch.randn(U, h, 256, device="cuda", dtype=torch.bfloat16) for h in (16, 2, 2))
    weight = torch.randn(U, 16, 256, device="cuda")
    subtree_end = packed.subtree_end.cuda()
    outputs = {}

    def run(backend, dtype):
        inputs = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        out = tree_attention(*inputs, subtree_end, backend=backend, layout=layout)
        return [out.detach()] + list(torch.autograd.grad((out.float() * weight).sum(), inputs))

    for kernel in ("torch", "fa4"):
        varlen.KERNEL = kernel
        try:
            start = time.perf_counter()
            outputs[kernel] = run("varlen", torch.bfloat16)
            torch.cuda.synchronize()
            row[f"varlen_{kernel}_first_s"] = time.perf_counter() - start
            leaves = [x.detach().requires_grad_() for x in (q, k, v)]
            row[f"varlen_{kernel}_s"] = bench(lambda leaves=leaves: backward(tree_attention(
                *leaves, subtree_end, backend="varlen", layout=layout)))
            row[f"varlen_{kernel}_pairs_per_s"] = stats["tree_attention_pairs"] / row[f"varlen_{kernel}_s"]
        except Exception as error:  # noqa: BLE001 - report and keep the other kernel's numbers
            row[f"varlen_{kernel}_error"] = repr(error)
        finally:
            varlen.KERNEL = "auto"
    reference = run("runs", torch.float32) if U <= 20_000 else outputs.get("torch")
    names = ("out", "dq", "dk", "dv")
    for kernel, result in outputs.items():
        if reference is not None:
            row[f"varlen_{kernel}_error"] = {n: rel(a, b) for n, a, b in zip(names, result, reference)}
    print(f"  varlen kernels ({'vs fp32' if U <= 20_000 else 'vs torch'}): " + ", ".join(
        f"{kernel} {row.get(f'varlen_{kernel}_s', float('nan')) * 1e3:.1f} ms (first "
        f"{row.get(f'varlen_{kernel}_first_s', float('nan')):.1f} s) {row.get(f'varlen_{kernel}_error')}"
        for kernel in ("torch", "fa4")), flush=True)


def gdn_timing(row, packed, plan, U, backward, profile: bool = False) -> None:
    """Gated delta rule at Qwen3-Next-2B shapes (16 key heads, 32 value heads, 128 dims): the tree nodes vs one
    varlen fla call over the tree's runs."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    from harts_hf.kernels import tree_gated_delta_rule
    from harts_hf.kernels.tree_gated_delta_rule import fla_backend
    from harts_hf.kernels.tree_gated_delta_rule.fla_backend import tree_gated_delta_rule_fla_autograd

    inputs = gdn_inputs(U, 16, 32, 128, 128)

    run_starts = torch.nonzero(packed.parent != torch.arange(U) - 1)[:, 0]
    run_lengths = torch.diff(torch.cat([run_starts, torch.tensor([U])]))
    cu_runs = torch.nn.functional.pad(run_lengths.cumsum(0), (1, 0)).to("cuda")

    def node():  # the tree node as the model calls it
        backward(tree_gated_delta_rule(*inputs, plan, use_qk_l2norm_in_kernel=True, backend="fla"))

    def single():  # one fla varlen call over the tree's runs
        backward(chunk_gated_delta_rule(*(x.unsqueeze(0) for x in inputs), cu_seqlens=cu_runs,
                                        use_qk_l2norm_in_kernel=True)[0])

    def tree(batched=True, state_pass="auto"):
        return bench(lambda: batched_rounds(node, batched=batched, state_pass=state_pass))

    row["gdn_tree_s"] = tree()  # as the model runs it: the round-batched node, the state pass "auto" picks
    row["gdn_tree_graphs_s"] = graphs(tree)  # the same with the node's bodies as CUDA graphs
    row["gdn_state_pass_auto"] = batched_rounds(lambda: fla_backend.state_pass_for(plan), state_pass="auto")
    row["gdn_tree_fused_s"] = tree(batched=False)
    for state_pass in ("rounds", "serial", "lanes"):
        row[f"gdn_tree_{state_pass}_s"] = tree(state_pass=state_pass)
    row["gdn_lanes"] = lanes_shape(plan)
    serial_blocks(row, tree)
    row["gdn_tree_per_round_s"] = bench(lambda: backward(tree_gated_delta_rule_fla_autograd(
        *inputs, plan, scale=128 ** -0.5, use_qk_l2norm_in_kernel=True)))
    row["gdn_single_call_s"] = bench(single)
    row["gdn_single_call_runs"] = int(run_lengths.numel())
    for variant in ("", "_fused", "_rounds", "_serial", "_lanes"):
        row[f"gdn_tree{variant}_over_single"] = row[f"gdn_tree{variant}_s"] / row["gdn_single_call_s"]
    if profile:  # where the tree node's time beyond one varlen call goes
        row["gdn_tree_kernels"] = kernel_breakdown(node, top=20, label="gdn_tree_kernels")
        row["gdn_single_call_kernels"] = kernel_breakdown(single, top=20, label="gdn_single_call_kernels")
    print(f"  gdn: tree {row['gdn_tree_s'] * 1e3:.1f} ms (auto: {row['gdn_state_pass_auto']}; with CUDA graphs "
          f"{row['gdn_tree_graphs_s'] * 1e3:.1f}); state pass rounds "
          f"{row['gdn_tree_rounds_s'] * 1e3:.1f}, serial {row['gdn_tree_serial_s'] * 1e3:.1f}, lanes "
          f"{row['gdn_tree_lanes_s'] * 1e3:.1f} ({row['gdn_lanes']}); fused per-round node "
          f"{row['gdn_tree_fused_s'] * 1e3:.1f}; one varlen call {row['gdn_single_call_s'] * 1e3:.1f}", flush=True)


def serial_blocks(row, tree) -> None:
    """The serial state pass's node time at each value block of :data:`SERIAL_BLOCKS` (the default restored
    after); ``row["gdn_tree_serial_bv{B}_s"]``."""
    from harts_hf.kernels.tree_gated_delta_rule import serial_state_pass

    default = serial_state_pass.VALUE_BLOCK
    try:
        for block in SERIAL_BLOCKS:
            serial_state_pass.VALUE_BLOCK = block
            row[f"gdn_tree_serial_bv{block}_s"] = seconds = tree(state_pass="serial")
            print(f"  gdn serial pass, value block {block}: {seconds * 1e3:.1f} ms", flush=True)
    finally:
        serial_state_pass.VALUE_BLOCK = default


def lanes_shape(plan) -> dict:
    """Units, lanes, waves and the serial chain in chunk steps: every chunk (serial pass) vs the longest lane of
    each wave, summed (lanes)."""
    from harts_hf.kernels.tree_gated_delta_rule.serial_state_pass import serial_units

    units = serial_units(plan, "cpu", lanes=True)
    chunks = ((units.eos - units.bos + plan.chunk_size - 1) // plan.chunk_size).tolist()
    start = units.lane_start.tolist()
    chain = sum(max(sum(chunks[start[lane]: start[lane + 1]]) for lane in range(first, end))
                for first, end in units.waves)
    return dict(units=units.num_units, lanes=len(start) - 1, waves=len(units.waves), serial_chunks=sum(chunks),
                lanes_chain_chunks=chain)


def attention_timing(row, packed, layout, stats, sequences, backward, profile) -> None:
    """Attention with 16 query heads, 2 KV heads, head_dim 256: the tree varlen path vs SDPA causal on one plain
    16k sequence and vs the per-trajectory path (flash varlen over the trajectories), in attended pairs per second."""
    import torch.nn.functional as F

    from harts_hf.kernels import tree_attention
    from harts_hf.kernels.tree_attention.split import run_blocks

    U = packed.num_tokens
    make = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)  # noqa: E731
    q, k, v = make(U, 16, 256), make(U, 2, 256), make(U, 2, 256)
    tree_pairs = stats["tree_attention_pairs"]
    subtree_end = packed.subtree_end.cuda()
    row["attention_tree_s"] = bench(lambda: backward(tree_attention(q, k, v, subtree_end, backend="varlen",
                                                                    layout=layout)))
    L = 16384
    qs, ks, vs = make(1, 16, L, 256), make(1, 2, L, 256), make(1, 2, L, 256)
    row["attention_sdpa_causal_s"] = bench(lambda: backward(F.scaled_dot_product_attention(
        qs, ks, vs, is_causal=True, enable_gqa=True)))
    tree_rate = tree_pairs / row["attention_tree_s"]
    plain_rate = L * (L + 1) / 2 / row["attention_sdpa_causal_s"]
    row["attention_pairs_per_s_tree"], row["attention_pairs_per_s_sdpa_causal"] = tree_rate, plain_rate
    row["attention_tree_over_sdpa_rate"] = tree_rate / plain_rate
    qs = ks = vs = None
    from harts_hf.kernels.tree_attention import ops as attention_ops

    def cudnn():
        backward(tree_attention(q, k, v, subtree_end, backend="cudnn", layout=layout))

    for name, key_block in (("attention_cudnn", None), ("attention_cudnn_bucketed", 4096)):
        attention_ops.CUDNN_KEY_BLOCK = key_block  # bucketed: the first call builds only shapes not seen before
        try:
            start = time.perf_counter()  # first call: cuDNN builds its plans for this forest's block shapes
            cudnn()
            torch.cuda.synchronize()
            row[f"{name}_first_s"] = time.perf_counter() - start
            row[f"{name}_s"] = bench(cudnn)
            row[f"{name}_shapes"] = len(run_blocks(layout, key_block=key_block).shapes())
        finally:
            attention_ops.CUDNN_KEY_BLOCK = None
    row["attention_cudnn_over_sdpa_rate"] = tree_pairs / row["attention_cudnn_s"] / plain_rate
    row["attention_parity"] = attention_parity(q, k, v, subtree_end, layout, fp32_reference=U <= 20_000)
    print(f"  attention parity: {row['attention_parity']}", flush=True)
    if profile:
        row["attention_tree_kernels"] = kernel_breakdown(lambda: backward(tree_attention(
            q, k, v, subtree_end, backend="varlen", layout=layout)), label="attention_tree_kernels")
    q = k = v = None
    row["attention_paths"] = path_attention(make, sequences, 600_000, backward)
    row["attention_tree_over_paths_rate"] = tree_rate / row["attention_paths"]["pairs_per_s"]
    print(f"  attention: tree {row['attention_tree_s'] * 1e3:.1f} ms for {tree_pairs:.3g} pairs; rate vs SDPA causal "
          f"16k {row['attention_tree_over_sdpa_rate']:.2f}x, vs the trajectories' own varlen "
          f"{row['attention_tree_over_paths_rate']:.2f}x; cuDNN per run {row['attention_cudnn_s'] * 1e3:.1f} ms "
          f"({row['attention_cudnn_over_sdpa_rate']:.2f}x SDPA's rate; first call "
          f"{row['attention_cudnn_first_s']:.2f} s, {row['attention_cudnn_shapes']} shapes); bucketed "
          f"{row['attention_cudnn_bucketed_s'] * 1e3:.1f} ms (first call {row['attention_cudnn_bucketed_first_s']:.2f} "
          f"s, {row['attention_cudnn_bucketed_shapes']} shapes)", flush=True)


def attention_parity(q, k, v, subtree_end, layout, fp32_reference: bool) -> dict:
    """Outputs and q/k/v gradients (one fixed random weighting) of the cuDNN per-run path and flash varlen, each
    against the fp32 per-run SDPA path (small forests) and against each other: relative Frobenius errors."""
    from harts_hf.kernels import tree_attention

    torch.manual_seed(1)
    weight = torch.randn(q.shape, device="cuda", dtype=torch.float32)

    def run(backend, dtype):
        inputs = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        out = tree_attention(*inputs, subtree_end, backend=backend, layout=layout)
        grads = torch.autograd.grad((out.float() * weight).sum(), inputs)
        return [out.detach()] + list(grads)

    results = {"varlen": run("varlen", torch.bfloat16), "cudnn": run("cudnn", torch.bfloat16)}
    if fp32_reference:
        results["fp32"] = run("runs", torch.float32)
    names = ("out", "dq", "dk", "dv")
    report = {f"cudnn_vs_varlen_{n}": rel(a, b) for n, a, b in zip(names, results["cudnn"], results["varlen"])}
    if fp32_reference:
        for backend in ("varlen", "cudnn"):
            report.update({f"{backend}_vs_fp32_{n}": rel(a, b) for n, a, b in
                           zip(names, results[backend], results["fp32"])})
    return report


def conv_timing(row, U, ancestors, backward) -> None:
    """Tree conv1d (shifted multiply-adds, and fla's fused bulk) vs a plain depthwise conv over U rows, at the 2B
    model's conv_dim = 2 * 16 * 128 + 32 * 128, bf16 inputs and fp32 weights as under autocast; and each bulk's
    relative error against fp64 (output, input and weight gradients)."""
    import torch.nn.functional as F

    from harts_hf.kernels import tree_causal_conv1d
    from harts_hf.kernels.tree_conv1d import conv_window_fixups

    C = 8192
    x = torch.randn(U, C, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(C, 4, device="cuda", requires_grad=True)
    fixups = conv_window_fixups(ancestors, 4)  # once per forest, as TreeMetadata caches it for the model
    probe = torch.randn(U, C, device="cuda")

    def grads(x, weight, bulk):
        y = tree_causal_conv1d(x, weight, None, ancestors, activation="silu", fixups=fixups, backend=bulk)
        return [y.detach().double(), *(g.double() for g in torch.autograd.grad((y.double() * probe).sum(), [x, weight]))]

    truth = grads(x.detach().double().requires_grad_(), weight.detach().double().requires_grad_(), "torch")
    for bulk in ("torch", "fla"):  # the shifted multiply-adds / fla's fused causal_conv1d (BULK_BACKEND)
        key = "conv_tree_s" if bulk == "torch" else "conv_tree_fla_s"
        row[key] = bench(lambda bulk=bulk: backward(
            tree_causal_conv1d(x, weight, None, ancestors, activation="silu", fixups=fixups, backend=bulk)))
        row[key.replace("_s", "_error")] = [float((a - b).norm() / b.norm()) for a, b in zip(grads(x, weight, bulk), truth)]
    row["conv_fixup_rows"] = int(fixups.numel())
    low = weight.detach().bfloat16().requires_grad_()  # the plain conv under autocast: bf16 weights
    row["conv_plain_s"] = bench(lambda: backward(F.silu(F.conv1d(x.t().unsqueeze(0), low.unsqueeze(1), padding=3,
                                                                  groups=C)[..., :U])))
    print(f"  conv: tree {row['conv_tree_s'] * 1e3:.2f} ms, fla bulk {row['conv_tree_fla_s'] * 1e3:.2f} ms, plain "
          f"{row['conv_plain_s'] * 1e3:.2f} ms; error vs fp64 (out, dx, dw): shifted "
          f"{', '.join(f'{e:.1e}' for e in row['conv_tree_error'])}, fla "
          f"{', '.join(f'{e:.1e}' for e in row['conv_tree_fla_error'])}", flush=True)


def token_ops_step(results: dict, rows: int = 97_199) -> None:
    """The fused per-token kernels against their references at the 2B preset's shapes on ``rows`` tokens (full-size
    `tau`'s unique count): fwd+bwd time of each, and the bf16 error of each against fp64 (relative Frobenius, output
    and every input gradient) next to the reference's own error, as the model calls them (decoder norm on the fp32
    residual stream, q/k norm and gated norm on bf16, SwiGLU on bf16, log-prob / entropy through the chunked LM
    head under bf16 autocast with fp32 weights, on 8,192 rows: two chunks)."""
    from bench_tree_vs_trajectory import use_kernels

    from harts_hf.kernels import token_ops
    from harts_hf.kernels.chunked_logprobs import chunked_logprobs

    torch.manual_seed(0)
    cuda = functools.partial(torch.randn, device="cuda")
    head_rows = 8_192  # two LM-head chunks (the fp64 truth holds [rows, vocab] four times over)

    def rms(x, w, offset=True):  # fp64 truths
        x_hat = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6)
        return x_hat * (1 + w) if offset else x_hat * w

    def head_truth(h, w):
        log_probs = (h @ w.t()).log_softmax(-1)
        labels = torch.arange(h.shape[0], device=h.device) * 7919 % w.shape[0]
        return torch.cat([log_probs.gather(-1, labels[:, None])[:, 0], -(log_probs.exp() * log_probs).sum(-1)])

    cases = {  # name: (the op as the model calls it, its fp64 truth, inputs)
        "decoder_norm": (lambda x, w: token_ops.rms_norm(x, w, 1e-6, offset=True), rms,
                         [cuda(rows, 2048), cuda(2048) * 0.1]),
        "qk_norm": (lambda x, w: token_ops.rms_norm(x, w, 1e-6, offset=True), rms,
                    [cuda(rows, 16, 256, dtype=torch.bfloat16), cuda(256) * 0.1]),
        "gated_norm": (lambda x, z, w: token_ops.gated_rms_norm(x, z, w, 1e-6),
                       lambda x, z, w: rms(x, w, offset=False) * torch.nn.functional.silu(z),
                       [cuda(rows * 32, 128, dtype=torch.bfloat16), cuda(rows * 32, 128, dtype=torch.bfloat16),
                        1 + cuda(128) * 0.1]),
        "swiglu": (token_ops.swiglu, lambda g, u: torch.nn.functional.silu(g) * u,
                   [cuda(rows, 6144, dtype=torch.bfloat16), cuda(rows, 6144, dtype=torch.bfloat16)]),
        # Kimi Delta Attention's gated norm (Kimi Linear, Ling 3): all in fp32, a sigmoid gate
        "kda_gated_norm": (lambda x, z, w: token_ops.gated_rms_norm(x, z, w, 1e-6, activation="sigmoid", fp32=True),
                           lambda x, z, w: rms(x, w, offset=False) * torch.sigmoid(z),
                           [cuda(rows * 32, 128, dtype=torch.bfloat16), cuda(rows * 32, 128, dtype=torch.bfloat16),
                            1 + cuda(128) * 0.1]),
        # Mamba-2's grouped gated norm at the Nemotron-H-shaped preset's width (4,096 channels, 8 groups)
        "group_gated_norm": (lambda x, z, w: token_ops.group_gated_rms_norm(x, z, w, 1e-6, 512),
                             lambda x, z, w: w * rms((x * torch.nn.functional.silu(z)).view(-1, 8, 512), 1,
                                                     offset=False).view(x.shape),
                             [cuda(rows, 4096, dtype=torch.bfloat16), cuda(rows, 4096, dtype=torch.bfloat16),
                              1 + cuda(4096) * 0.1]),
        # Nemotron-H's MLP activation at its preset's width; the reference squares in bf16 (no autocast here)
        "relu_squared": (token_ops.relu_squared, lambda x: torch.relu(x).square(),
                         [cuda(rows, 8192, dtype=torch.bfloat16)]),
        # Nemotron-H's decoder norm: the weight applied in fp32, the result in the input's dtype
        "decoder_norm_fp32_weight": (lambda x, w: token_ops.rms_norm(x, w, 1e-6, offset=False, fp32_weight=True),
                                     lambda x, w: rms(x, w, offset=False), [cuda(rows, 2048), 1 + cuda(2048) * 0.1]),
        "lm_head": (lambda h, w: torch.cat(_head_logprobs(chunked_logprobs, w, h)), head_truth,
                    [cuda(head_rows, 2048), cuda(151_936, 2048) * 2048 ** -0.5]),
    }
    token = results.setdefault("token_ops", {"rows": rows})
    for name, (function, truth, inputs) in cases.items():
        leaves = [x.requires_grad_() for x in inputs]
        row = token.setdefault(name, {})
        outputs = {}
        # fused: fla's kernels (fla's RMSNorm); harts_norm: the norms on harts_hf's own RMSNorm kernel (the default)
        fused = ["fused"] + (["harts_norm"] if name in ("decoder_norm", "qk_norm", "decoder_norm_fp32_weight") else [])
        for kernels in ["reference", *fused, "fp64"]:
            use_kernels({"fused": "fused_fla_norm", "harts_norm": "fused_norm"}.get(kernels, "reference"))
            args = [x.detach().double().requires_grad_() for x in leaves] if kernels == "fp64" else leaves
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=name == "lm_head" and kernels != "fp64"):
                out = (truth if kernels == "fp64" else function)(*args)
                grads = torch.autograd.grad(out.float().square().sum(), args, allow_unused=True)
            outputs[kernels] = [out.detach()] + [g for g in grads]
            if kernels != "fp64":
                def step(args=args, function=function, autocast=name == "lm_head"):
                    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                        y = function(*args)
                        torch.autograd.grad(y.float().square().sum(), args, allow_unused=True)
                row[f"{kernels}_s"] = bench(step, repeats=3)
        use_kernels("fused")
        for kernels in ["reference", *fused]:
            row[f"{kernels}_error_vs_fp64"] = [None if b is None or a is None else rel(a, b)
                                               for a, b in zip(outputs[kernels], outputs["fp64"])]
        row["speedup"] = row["reference_s"] / row["fused_s"]
        print(f"  {name}: " + "; ".join(
            f"{kernels} {row[f'{kernels}_s'] * 1e3:.2f} ms, error vs fp64 (out, grads) "
            f"{[f'{e:.1e}' for e in row[f'{kernels}_error_vs_fp64'] if e is not None]}"
            for kernels in ["reference", *fused]), flush=True)
        del leaves, outputs
        torch.cuda.empty_cache()


def _head_logprobs(chunked_logprobs, weight, hidden):
    """Log-probs and entropies of ``hidden [N, H]`` through an LM head of ``weight [vocab, H]`` (fixed labels)."""
    labels = torch.arange(hidden.shape[0], device=hidden.device) * 7919 % weight.shape[0]
    return chunked_logprobs(_FunctionalHead(weight), hidden, labels, compute_entropy=True, functional_head=True)


class _FunctionalHead:
    """What ``chunked_logprobs(functional_head=True)`` reads of a head: its weight and bias."""

    def __init__(self, weight):
        self.weight, self.bias = weight, None


PARITY_STEPS = {"graph": graph_parity, "gdn": parity, "handoff": handoff_parity, "final_state": final_state_parity}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="results")
    parser.add_argument("--workloads", nargs="*", default=["swe:0.1", "tau:0.1", "grpo:0.1"],
                        help="name:scale[:seed] (a second seed shows what a new forest of the same preset costs)")
    parser.add_argument("--ops", nargs="+", default=["gdn", "attention", "conv"],
                        choices=["gdn", "attention", "conv", "token", "varlen_kernels", "attention_features"],
                        help="which ops to time on each workload; token: the fused per-token kernels against their "
                             "references, once at full-size tau's unique-token count; attention_features: sliding "
                             "window, latent-attention head dims, softcapping and sinks, tree and per-trajectory "
                             "against fp32")
    parser.add_argument("--skip-parity", action="store_true", help="timing only")
    parser.add_argument("--parity", nargs="+", default=list(PARITY_STEPS), choices=list(PARITY_STEPS),
                        help="which parity checks run first (default: all)")
    parser.add_argument("--varlen-kernel", default=None, choices=["torch", "fa4", "auto"],
                        help="the tree attention's varlen kernel (harts_hf.kernels.tree_attention.varlen.KERNEL) for "
                             "every op timed; fa4 also runs softcapping and sinks (attention_features) on the varlen "
                             "path")
    parser.add_argument("--profile", action="store_true",
                        help="also list the kernels of the tree GDN node, of the one varlen fla call and of the tree "
                             "attention by device time (torch.profiler)")
    parser.add_argument("--serial-blocks", nargs="*", type=int, default=[], choices=[16, 32, 64], metavar="BLOCK",
                        help="also time the GDN node's serial state pass with these value blocks "
                             "(serial_state_pass.VALUE_BLOCK, default 32), e.g. 16 64")
    args = parser.parse_args()
    SERIAL_BLOCKS[:] = args.serial_blocks
    if args.varlen_kernel is not None:
        from harts_hf.kernels.tree_attention import varlen

        varlen.KERNEL = args.varlen_kernel
    from run_record import write_run_record

    out = Path(args.out)
    write_run_record(out)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}

    def save():
        (out / "gpu_kernels.json").write_text(json.dumps(results, indent=2, default=str))

    steps = [] if args.skip_parity else [(f"{name}_parity", PARITY_STEPS[name]) for name in args.parity]
    if "token" in args.ops:
        steps.append(("token_ops", token_ops_step))
    steps += [(spec, lambda r, s=spec: timing(r, s.split(":")[0], float(s.split(":")[1]), args.ops,
                                              args.profile, int(s.split(":")[2]) if s.count(":") > 1 else 0))
              for spec in args.workloads]
    for name, step in steps:
        start = time.perf_counter()
        try:
            step(results)
        except Exception:  # keep going: report what broke and where
            import traceback

            results[f"{name}_error"] = traceback.format_exc()
            print(results[f"{name}_error"], flush=True)
        results[f"{name}_wall_s"] = time.perf_counter() - start
        save()
        print(f"done {name} in {results[f'{name}_wall_s']:.0f} s", flush=True)
    print(json.dumps(results.get("parity", {}), indent=1))
    print("| workload | U | rounds | GDN tree ms | per-round ms | single call ms | tree/single | attn tree ms | "
          "attn rate vs SDPA causal | conv tree ms | conv plain ms | metadata ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, row in results.get("timing", {}).items():
        s = row["stats"]
        print(f"| {name} | {s['unique_tokens']} | {s['gdn_rounds']} | {_cell(row, 'gdn_tree_s')} | "
              f"{_cell(row, 'gdn_tree_per_round_s')} | {_cell(row, 'gdn_single_call_s')} | "
              f"{_cell(row, 'gdn_tree_over_single', ratio=True)} | {_cell(row, 'attention_tree_s')} | "
              f"{_cell(row, 'attention_tree_over_sdpa_rate', ratio=True)} | {_cell(row, 'conv_tree_s')} | "
              f"{_cell(row, 'conv_plain_s')} | {_cell(row, 'metadata_seconds')} |")


def _cell(row: dict, key: str, ratio: bool = False) -> str:
    """``row[key]`` in ms (or as a ratio), or '-' for an op not timed (``--ops``)."""
    if key not in row:
        return "-"
    return f"{row[key]:.2f}" if ratio else f"{1e3 * row[key]:.1f}"


if __name__ == "__main__":
    main()
