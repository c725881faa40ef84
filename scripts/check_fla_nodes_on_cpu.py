"""Run the ``"fla"`` tree gated delta rule nodes through fla's real Triton kernels on the CPU (Triton's interpreter).

The fla nodes (the fused per-round node and the round-batched node, ``fla_backend.BATCH_ROUNDS``, with fla's state
pass per round, with the one-launch serial state pass and with its heavy-path lanes, ``fla_backend.STATE_PASS``;
fla's public function once per round, ``fla_backend.PUBLIC_PER_ROUND``) against the fp32 torch backend, on a forest
of nested forks (several rounds) and on planner pieces with hand-offs (handed-in state, context rows, requested
states); then a tiny patched Qwen3-Next with the fla backend against the torch backend (log-probs and every
parameter gradient; the node's two state passes and the executed layout); the tree conv with fla's ``causal_conv1d``
for its bulk; Kimi Delta Attention (a tiny Ling 3 model too) and gated linear attention (Mamba-2; a tiny Nemotron-H
too) through their round-batched nodes over fla's ``chunk_kda`` / ``chunk_simple_gla`` stages and through those
functions per round; the fused per-token kernels (with fla's RMSNorm and with harts_hf's own). fp32 throughout, but
for Mamba-2's node once on fp16 inputs (``mamba2.SCAN_INPUTS = "half"``); about 18 minutes on one core of this machine
(2026-12-07), each part's seconds printed as it ends.

Triton must be importable, at the version the interpreter bridges below were written for (3.6.0, the GPU
machine's): ``bash scripts/run.sh test`` runs this in a helper venv (``.harts-env/triton``) that sees the active
environment's packages with triton 3.6.0 on top.

Two interpreter gaps are bridged here, not in the library: fla's kernels call ``.to(tl.int64)`` on loop counters
(Python ints under the interpreter), so a copy of fla with those casts spelled ``tl.cast`` is imported from a
temporary folder; and the interpreter's ``__index__`` on one-element blocks is widened. Autotuning is cut to each
kernel's first configuration (the interpreter has no benchmarker), KDA's kernels to their largest blocks (fewer
programs to interpret).
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import random
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _prepare_interpreter() -> Path:
    import triton.runtime.autotuner as autotuner
    import triton.runtime.interpreter as interpreter

    first_only = autotuner.Autotuner.__init__

    def blocks(config) -> int:  # the product of the config's integer meta-parameters (block sizes)
        return math.prod(v for v in config.kwargs.values() if isinstance(v, int) and not isinstance(v, bool))

    def one_config(self, fn, arg_names, configs, *args, **kwargs):
        # KDA's kernels at their largest blocks (fewer programs to interpret: fla's token-parallel intra-chunk kernel
        # runs one program per token and head block, and at one head per block it alone took 3 of a KDA node run's
        # 4 minutes here); the others at their first (larger blocks made the Gated DeltaNet kernels slower)
        module = getattr(getattr(fn, "fn", None), "__module__", "") or ""
        pick = max(reversed(configs), key=blocks) if module.startswith("fla.ops.kda") else configs[0]
        first_only(self, fn, arg_names, [pick], *args, **kwargs)

    autotuner.Autotuner.__init__ = one_config
    patch = interpreter._patch_lang_tensor

    def widened(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = widened
    source = Path(importlib.util.find_spec("fla").origin).parent
    copy = Path(tempfile.mkdtemp()) / "fla"
    shutil.copytree(source, copy)
    cast = re.compile(r"\b(i_[a-z_0-9]*)\.to\(tl\.int64\)")
    for path in (copy / "ops").rglob("*.py"):
        text = path.read_text()
        if cast.search(text):
            path.write_text(cast.sub(r"tl.cast(\1, tl.int64)", text))
    sys.path.insert(0, str(copy.parent))
    return copy


_LAP = [time.perf_counter()]


def lap(what: str) -> None:
    """Print the seconds since the previous lap: where the check's time goes (it is CI's longest part)."""
    now = time.perf_counter()
    print(f"  [{now - _LAP[0]:.0f} s: {what}]", flush=True)
    _LAP[0] = now


def rel(a, b) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check_value_blocks() -> float:
    """The serial pass (and its lanes) with two programs per value head: value heads of 32 columns in blocks of 16
    (``serial_state_pass.VALUE_BLOCK``; the other checks' heads fit one block), vs the fp32 torch backend, on forks
    at chunk offsets 0, 1, 63, 64, 65, 127-129 with nested forks."""
    import torch

    from harts_hf.kernels import build_gated_delta_plan, tree_gated_delta_rule
    from harts_hf.kernels.tree_gated_delta_rule import fla_backend, serial_state_pass
    from harts_hf.trees import PrefixForest
    from tests.forests import chunk_edge_sequences

    packed = PrefixForest.from_sequences(chunk_edge_sequences()).pack()
    plans = {"torch": build_gated_delta_plan(packed), "fla": build_gated_delta_plan(packed, final_states_only=True)}
    torch.manual_seed(1)
    U = packed.num_tokens
    leaves = [t.requires_grad_() for t in (torch.randn(U, 1, 16), torch.randn(U, 1, 16), torch.randn(U, 2, 32),
                                           -torch.rand(U, 2) * 0.2, torch.rand(U, 2))]
    outputs = {}
    saved = serial_state_pass.VALUE_BLOCK, fla_backend.BATCH_ROUNDS, fla_backend.STATE_PASS
    serial_state_pass.VALUE_BLOCK = 16
    try:
        for name, state_pass in (("torch", "rounds"), ("fla_serial", "serial"), ("fla_lanes", "lanes")):
            fla_backend.BATCH_ROUNDS, fla_backend.STATE_PASS = True, state_pass
            backend = name.split("_")[0]
            out = tree_gated_delta_rule(*leaves, plans[backend], backend=backend, use_qk_l2norm_in_kernel=True)
            outputs[name] = (out.detach(), torch.autograd.grad(out.square().sum(), leaves))
    finally:
        serial_state_pass.VALUE_BLOCK, fla_backend.BATCH_ROUNDS, fla_backend.STATE_PASS = saved
    worst = 0.0
    for name in ("fla_serial", "fla_lanes"):
        errors = [rel(outputs[name][0], outputs["torch"][0]),
                  max(rel(a, b) for a, b in zip(outputs[name][1], outputs["torch"][1]))]
        print(f"two value blocks per head: {name} vs torch: out {errors[0]:.1e} grads {errors[1]:.1e}", flush=True)
        worst = max(worst, *errors)
    return worst


def recurrence_inputs(rows: int, per_channel: bool, H: int = 1, HV: int = 2, K: int = 16, V: int = 16) -> list:
    """``q, k [rows, H, K]``, ``v [rows, HV, V]``, gates (``[rows, HV, K]`` per channel, else ``[rows, HV]``) in
    ``[-0.3, 0]`` and ``beta [rows, HV]``, drawn in that order, each requiring grad."""
    import torch

    q, k, v = torch.randn(rows, H, K), torch.randn(rows, H, K), torch.randn(rows, HV, V)
    gate = -torch.rand(rows, HV, K) * 0.3 if per_channel else -torch.rand(rows, HV) * 0.3
    return [t.requires_grad_() for t in (q, k, v, gate, torch.rand(rows, HV))]


def check_round_node(label: str, per_channel: bool, delta: bool, chunk_size: int = 64) -> float:
    """The fla nodes of the other recurrences vs the fp32 torch backend: Kimi Delta Attention (per-channel gates,
    :mod:`.fla_kda`, fla's ``chunk_kda``) or gated linear attention (``delta=False``, per-head gates,
    :mod:`.fla_simple_gla` on the plan's chunk grid, fla's ``chunk_simple_gla``): each as the round-batched node over
    fla's stages and as fla's public function per round (the same to rounding). The whole forest of forks at chunk
    offsets 0, 1, 63, 64, 65, 127-129 (three rounds; both nodes), and a planner piece below a branch point
    (handed-in state, context rows, requested states; the default node); outputs, states and every input gradient."""
    import torch

    from harts_hf.kernels import build_gated_delta_plan, tree_gated_delta_rule
    from harts_hf.kernels.tree_gated_delta_rule.executed import executed_rows
    from harts_hf.trees import PrefixForest
    from tests.forests import chunk_edge_sequences

    HV, K, V = 2, 16, 16
    inputs = functools.partial(recurrence_inputs, per_channel=per_channel)

    from harts_hf.kernels.tree_gated_delta_rule import fla_backend, fla_kda, fla_simple_gla

    options = dict(use_qk_l2norm_in_kernel=delta, delta=delta)
    # two fla nodes each: the round-batched one (the default) and fla's public function per round; the delta rule's
    # round-batched node also with the serial state pass (harts_hf's kernels; per-channel gates for KDA; its lanes run
    # the same kernels, checked in main() for Gated DeltaNet)
    serial = ("fla_serial",) if delta else ()
    # and the round-batched node on the plan's executed view, fed its executed rows (the mixers' executed layout)
    variants = ("fla", *serial, "fla_per_round", "fla_executed")

    def through(name, run):
        fla_kda.BATCH_ROUNDS = fla_simple_gla.BATCH_ROUNDS = name != "fla_per_round"
        fla_backend.STATE_PASS = {"fla_serial": "serial", "fla_lanes": "lanes"}.get(name, "rounds")
        try:
            return run("torch" if name == "torch" else "fla")
        finally:
            fla_kda.BATCH_ROUNDS = fla_simple_gla.BATCH_ROUNDS = True
            fla_backend.STATE_PASS = "auto"

    # forks at 0, 1, 63-65 and 127-129 with nested forks (3 rounds); a longer base path only adds tokens to interpret
    packed = PrefixForest.from_sequences(chunk_edge_sequences(base_len=140)).pack()
    torch.manual_seed(2)
    leaves = inputs(packed.num_tokens)
    outs = {}
    for name in ("torch", *variants):
        def run(backend, executed=name == "fla_executed"):
            the_plan = build_gated_delta_plan(packed, final_states_only=backend == "fla", chunk_size=chunk_size)
            if not executed:
                return tree_gated_delta_rule(*leaves, the_plan, backend=backend, **options), len(the_plan.rounds)
            rows = executed_rows(the_plan)
            out = tree_gated_delta_rule(*(rows.to_executed(x) for x in leaves), the_plan.executed_view(),
                                        backend=backend, **options)
            return rows.to_rows(out), len(the_plan.rounds)
        out, rounds = through(name, run)
        outs[name] = (out.detach(), torch.autograd.grad(out.square().sum(), leaves))
        lap(f"{label}, {name}")
    worst = 0.0
    for name in variants:
        errors = [rel(outs[name][0], outs["torch"][0])] + [rel(a, b) for a, b in zip(outs[name][1], outs["torch"][1])]
        print(f"{label}, {name} vs torch ({packed.num_tokens} tokens, {rounds} rounds, chunks of {chunk_size}): "
              f"out {errors[0]:.1e} grads {max(errors[1:]):.1e}", flush=True)
        worst = max(worst, *errors)
    between = [rel(outs["fla"][0], outs["fla_per_round"][0])] + \
        [rel(a, b) for a, b in zip(outs["fla"][1], outs["fla_per_round"][1])]
    print(f"{label}, round-batched vs per round: out {between[0]:.1e} grads {max(between[1:]):.1e}", flush=True)
    # the same kernels on the same chunks; only the order in which a replayed token's gradient terms (and, with
    # grouped value heads, the groups') are summed differs
    assert max(between) < 1e-6, f"{label}: the round-batched node differs from the per-round one: {between}"
    for name in serial:  # the same recurrence per chunk; only the state pass's products are summed in another order
        against = [rel(outs[name][0], outs["fla"][0])] + [rel(a, b) for a, b in zip(outs[name][1], outs["fla"][1])]
        print(f"{label}, {name} vs fla's state pass per round: out {against[0]:.1e} grads {max(against[1:]):.1e}",
              flush=True)
        assert max(against) < 1e-5, f"{label}: {name} differs from fla's state pass: {against}"
    # a piece below a branch token at depth 69: roots at depth 70, the state after 64 tokens, 6 replayed rows
    common = [1 + i % 5 for i in range(70)]
    whole = PrefixForest.from_sequences([common + [7] * 80, common + [8] * 9 + [9] * 60, common + [6] * 5]).pack()
    starts = whole.cu_seqlens[:-1].tolist()
    sub = whole.select([s for s, first in enumerate(starts) if int(whole.position_ids[first]) >= 70])
    depth, rows = 70, 70 % chunk_size
    state = (torch.randn(HV, K, V) * 0.1).requires_grad_()
    context, piece = inputs(rows), inputs(sub.num_tokens)
    outs = {}
    piece_variants = ("fla", *serial)  # the round-batched node (the per-round one is compared with it above)
    for name in ("torch", *piece_variants):
        def run(backend):
            the_plan = build_gated_delta_plan(sub, final_states_only=backend == "fla", state_requests=[5, 60],
                                              chunk_size=chunk_size)
            return tree_gated_delta_rule(*piece, the_plan, backend=backend, initial_state=state,
                                         context=tuple(context), output_requested_states=True, **options)
        out, states = through(name, run)
        total = out.square().sum() + sum(s.square().sum() for s in states if s is not None)
        outs[name] = ([out.detach()] + [s.detach() for s in states if s is not None],
                      torch.autograd.grad(total, piece + context + [state]))
        lap(f"{label} piece, {name}")
    for name in piece_variants:
        errors = [rel(a, b) for a, b in zip(outs[name][0], outs["torch"][0])] + \
            [rel(a, b) for a, b in zip(outs[name][1], outs["torch"][1])]
        print(f"{label} piece, {name} (root at depth {depth}, {rows} replayed rows, handed-in state, 2 requested "
              f"states): out/states {max(errors[:3]):.1e} grads {max(errors[3:]):.1e}", flush=True)
        worst = max(worst, *errors)
    return worst


def check_half_scan_inputs() -> None:
    """Mamba-2's scan node with half-precision ``q, k, v`` and fp32 gates (``mamba2.SCAN_INPUTS = "half"``) through
    fla's stages against the torch backend on the same inputs (which computes in fp32 and rounds its result once):
    outputs and every input gradient in the inputs' dtypes, within fp16's rounding (2e-3); fla's dq / dk / dg stage
    gets its inputs in the states' fp32 (the kernel fla 0.6 has on Hopper under Triton < 3.7.1 wants them so). fp16,
    not bf16: Triton's interpreter has no bf16; the kernels take either."""
    import torch

    from harts_hf.kernels import build_gated_delta_plan, tree_gated_delta_rule
    from harts_hf.kernels.tree_gated_delta_rule import fla_simple_gla
    from harts_hf.trees import PrefixForest
    from tests.forests import chunk_edge_sequences

    packed = PrefixForest.from_sequences(chunk_edge_sequences()).pack()
    torch.manual_seed(3)
    q, k, v, g, beta = recurrence_inputs(packed.num_tokens, per_channel=False)
    leaves = [t.detach().to(dtype).requires_grad_() for t, dtype in
              zip((q, k, v, g), (torch.float16, torch.float16, torch.float16, torch.float32))]
    outs, seen = {}, []
    stages = fla_simple_gla._stages

    def recording_stages() -> dict:  # the dtypes fla's dq / dk / dg stage gets (fla 0.6 on Hopper: h's dtype)
        found = stages()
        dqkwg = found["bwd_dqkwg"]
        found["bwd_dqkwg"] = lambda **kw: seen.append((kw["q"].dtype, kw["do"].dtype, kw["h"].dtype)) or dqkwg(**kw)
        return found

    fla_simple_gla._stages = recording_stages
    try:
        for backend in ("torch", "fla"):
            the_plan = build_gated_delta_plan(packed, final_states_only=backend == "fla", chunk_size=32)
            out = tree_gated_delta_rule(*leaves, torch.ones_like(g), the_plan, backend=backend, delta=False,
                                        scale=1.0)
            grads = torch.autograd.grad(out.float().square().sum(), leaves)
            assert out.dtype == torch.float16 and [x.dtype for x in grads] == [x.dtype for x in leaves], backend
            outs[backend] = (out.detach(), grads)
    finally:
        fla_simple_gla._stages = stages
    assert seen == [(torch.float32,) * 3], seen
    errors = [rel(a.float(), b.float()) for a, b in zip((outs["fla"][0], *outs["fla"][1]),
                                                         (outs["torch"][0], *outs["torch"][1]))]
    print(f"gated linear attention (Mamba-2), fp16 q/k/v: fla vs torch backend: out {errors[0]:.1e} grads "
          f"{max(errors[1:]):.1e}", flush=True)
    assert max(errors) < 2e-3, errors


def check_unshared_layout() -> float:
    """The three round-batched fla nodes (Gated DeltaNet, KDA, Mamba-2's gated linear attention) on a forest of
    unshared sequences, whose executed layout is the identity (the packed per-trajectory path's: the gathers into
    and out of it are views), vs the fp32 torch backend: outputs and every input gradient."""
    import torch

    from harts_hf.kernels import build_gated_delta_plan, tree_gated_delta_rule
    from harts_hf.kernels.tree_gated_delta_rule.round_batch import round_batch
    from harts_hf.trees import PrefixForest

    rng = random.Random(5)
    sequences = [[10 + i] + [rng.randrange(5) for _ in range(n - 1)] for i, n in enumerate((1, 63, 64, 65, 130))]
    packed = PrefixForest.from_sequences(sequences).pack()
    worst = 0.0
    for label, per_channel, delta in (("Gated DeltaNet", False, True), ("KDA", True, True),
                                      ("gated linear attention", False, False)):
        torch.manual_seed(4)
        leaves = recurrence_inputs(packed.num_tokens, per_channel)
        options = dict(use_qk_l2norm_in_kernel=delta) if label == "Gated DeltaNet" else \
            dict(use_qk_l2norm_in_kernel=delta, delta=delta)
        outs = {}
        for backend in ("torch", "fla"):
            the_plan = build_gated_delta_plan(packed, final_states_only=backend == "fla")
            if backend == "fla":
                assert round_batch(the_plan).identity, f"{label}: unshared sequences should give the identity layout"
            out = tree_gated_delta_rule(*leaves, the_plan, backend=backend, **options)
            outs[backend] = (out.detach(), torch.autograd.grad(out.square().sum(), leaves))
        errors = [rel(outs["fla"][0], outs["torch"][0])] + [rel(a, b) for a, b in zip(outs["fla"][1], outs["torch"][1])]
        print(f"{label}, unshared sequences (identity layout, {packed.num_tokens} tokens), fla vs torch: "
              f"out {errors[0]:.1e} grads {max(errors[1:]):.1e}", flush=True)
        worst = max(worst, *errors)
    return worst


def main() -> None:
    copy = _prepare_interpreter()
    import fla
    import torch

    from harts_hf.kernels import build_gated_delta_plan, tree_gated_delta_rule
    from harts_hf.kernels.tree_gated_delta_rule import fla_backend, ops
    from harts_hf.planner import plan
    from harts_hf.trees import PrefixForest
    from tests.test_handoff import _root_path, handoff_sequences

    assert Path(fla.__file__).parent == copy, f"fla came from {fla.__file__}, not from the patched copy {copy}"
    from harts_hf.kernels import metadata

    ops.resolve_backend = metadata.resolve_backend = lambda backend, tensor, op: backend  # CPU tensors through fla
    fla_backend._check = lambda q, plan: None
    torch.manual_seed(0)
    H, HV, K, V = 1, 2, 16, 16

    def inputs_for(U):
        tensors = [torch.randn(U, H, K), torch.randn(U, H, K), torch.randn(U, HV, V), -torch.rand(U, HV) * 0.2,
                   torch.rand(U, HV)]
        return [t.requires_grad_() for t in tensors]

    def run_all(run, leaves):
        outs = {}
        for name in ("torch", "fla", "fla_batched", "fla_serial", "fla_lanes", "fla_public"):
            fla_backend.BATCH_ROUNDS = name in ("fla_batched", "fla_serial", "fla_lanes")
            fla_backend.STATE_PASS = {"fla_serial": "serial", "fla_lanes": "lanes"}.get(name, "rounds")
            fla_backend.PUBLIC_PER_ROUND = name == "fla_public"  # fla's public function per round
            try:
                out, states = run("torch" if name == "torch" else "fla")
            finally:
                fla_backend.PUBLIC_PER_ROUND = False
            loss = out.square().sum() + sum(s.square().sum() for s in states if s is not None)
            outs[name] = (out.detach(), [s.detach() for s in states if s is not None],
                          torch.autograd.grad(loss, leaves))
        return outs

    def report(label, outs) -> float:
        worst = 0.0
        line = [label]
        for name, against in (("fla", "torch"), ("fla_batched", "torch"), ("fla_batched", "fla"),
                              ("fla_serial", "torch"), ("fla_serial", "fla"), ("fla_lanes", "torch"),
                              ("fla_lanes", "fla"), ("fla_public", "torch")):
            mine, ref = outs[name], outs[against]
            errors = [rel(mine[0], ref[0]), max([rel(a, b) for a, b in zip(mine[1], ref[1])], default=0.0),
                      max(rel(a, b) for a, b in zip(mine[2], ref[2]))]
            if name == "fla_batched" and against == "fla":
                assert max(errors) == 0.0, f"{label}: round-batched node differs from the fused node: {errors}"
            worst = max(worst, *errors)
            line.append(f"{name} vs {against}: out {errors[0]:.1e} states {errors[1]:.1e} grads {errors[2]:.1e}")
        print(" | ".join(line), flush=True)
        return worst

    # nested forks: every level restarts from the previous level's chunk boundary (several rounds); three more
    # children of the fork at 150 start from one state (sibling lanes adding to one row in the lanes backward)
    rng = random.Random(0)
    common = [rng.randrange(3) for _ in range(400)]
    packed = PrefixForest.from_sequences([common[: 75 * (i + 1)] + [3 + i] * (20 + 7 * i) for i in range(5)]
                                         + [common[:150] + [9 + i] * (30 + 11 * i) for i in range(3)]
                                         + [common]).pack()
    inputs = inputs_for(packed.num_tokens)
    plans = {"torch": build_gated_delta_plan(packed), "fla": build_gated_delta_plan(packed, final_states_only=True)}
    from harts_hf.kernels.tree_gated_delta_rule.serial_state_pass import serial_units

    lanes = serial_units(plans["fla"], torch.device("cpu"), lanes=True)
    assert len(lanes.waves) > 1 and max(end - first for first, end in lanes.waves) > 2, lanes.waves
    worst = report(f"forest: {plans['fla'].stats['rounds']} rounds, {lanes.lane_start.numel() - 1} lanes in "
                   f"{len(lanes.waves)} waves, {packed.num_tokens} tokens", run_all(
        lambda backend: (tree_gated_delta_rule(*inputs, plans[backend], backend=backend,
                                               use_qk_l2norm_in_kernel=True), []), inputs))
    lap("the forest on every Gated DeltaNet backend")
    check_fewer_stages(lambda: tree_gated_delta_rule(*inputs, plans["fla"], backend="fla",
                                                     use_qk_l2norm_in_kernel=True), inputs)
    worst = max(worst, check_value_blocks())
    lap("fewer pipelining stages, two value blocks")

    # planner pieces with hand-offs
    the_plan = plan(handoff_sequences(seed=3), token_budget=140)
    packed = the_plan.packed
    inputs = inputs_for(packed.num_tokens)
    cu = packed.cu_seqlens.tolist()
    for piece in the_plan.pieces:
        if piece.handoff is None:
            continue
        tokens = torch.cat([torch.arange(cu[s], cu[s + 1]) for s in piece.segments])
        sub = packed.select(piece.segments)
        d0 = int(packed.position_ids[tokens[0]])
        ancestors = _root_path(packed, int(tokens[0]))
        boundary = 64 * (d0 // 64)
        children = [p for p in the_plan.pieces if p.handoff is not None and p.handoff.source_piece == piece.index]
        branches = [int(torch.searchsorted(tokens, child.handoff.branch_token)) for child in children]
        state = torch.randn(HV, K, V).mul_(0.1).requires_grad_() if boundary else None
        context_rows = ancestors[boundary:] if d0 > boundary else None

        def run(backend, sub=sub, branches=branches, tokens=tokens, state=state, context_rows=context_rows):
            sub_plan = build_gated_delta_plan(sub, final_states_only=backend == "fla", state_requests=branches)
            context = None if context_rows is None else tuple(t[context_rows] for t in inputs)
            return tree_gated_delta_rule(*(t[tokens] for t in inputs), sub_plan, backend=backend,
                                         use_qk_l2norm_in_kernel=True, initial_state=state, context=context,
                                         output_requested_states=True)

        leaves = [*inputs, *([state] if state is not None else [])]
        worst = max(worst, report(f"piece {piece.index} (depth {d0}, {len(branches)} requested states)",
                                  run_all(run, leaves)))
    lap("planner pieces")
    worst = max(worst, check_conv())
    lap("tree conv")
    worst = max(worst, check_round_node("KDA", per_channel=True, delta=True))
    lap("KDA node")
    worst = max(worst, check_round_node("gated linear attention (Mamba-2)", per_channel=False, delta=False,
                                        chunk_size=32))
    lap("Mamba-2 node")
    worst = max(worst, check_unshared_layout())
    lap("unshared layout")
    worst = max(worst, check_model_backends("bailing_hybrid", "Ling 3"))
    lap("Ling 3 model")
    worst = max(worst, check_model_backends("nemotron_h", "Nemotron-H", executed=True))
    lap("Nemotron-H model")
    worst = max(worst, check_model())
    lap("Qwen3-Next model")
    check_kept_mixer_outputs()
    lap("kept mixer outputs")
    worst = max(worst, check_token_ops())
    lap("fused token ops")
    worst = max(worst, check_gather_rows())
    check_half_scan_inputs()
    lap("gathered rows, half-precision scan inputs")
    assert worst < 1e-5, f"fla nodes differ from the fp32 torch backend by {worst:.1e}"
    print(f"OK: worst relative error against the torch backend {worst:.1e}; round-batched == fused bit for bit; "
          "the serial state pass and its lanes within the same tolerance")


def check_conv() -> float:
    """The tree conv with fla's fused ``causal_conv1d`` for the bulk (``backend="fla"``) against the shifted
    multiply-adds (``"torch"``): a forest of many runs, and a planner piece whose root reads context rows; outputs and
    the gradients of x, weight, bias and context."""
    import torch

    from harts_hf.kernels.tree_conv1d import conv_window_fixups, tree_causal_conv1d
    from harts_hf.trees import PrefixForest
    from tests.test_handoff import handoff_sequences

    torch.manual_seed(0)
    rng = random.Random(1)
    common = [rng.randrange(5) for _ in range(60)]
    packed = PrefixForest.from_sequences([common[: 7 * (i + 2)] + [5 + i] * (3 + 2 * i) for i in range(6)]
                                         + handoff_sequences(seed=2)[:3]).pack()
    worst = 0.0
    C, W = 12, 4
    for context_rows in (0, 2):
        if context_rows:  # the children below one branch token of a cut forest: roots at one depth
            whole = PrefixForest.from_sequences([common[:20] + [7] + [8] * 9, common[:20] + [7] + [6] * 5,
                                                 common[:20] + [1] * 8]).pack()
            starts = whole.cu_seqlens[:-1].tolist()
            forest = whole.select([s for s, first in enumerate(starts) if int(whole.position_ids[first]) >= 20])
            table = forest.ancestor_table(W, context_rows)
        else:
            table, forest = packed.ancestor_table(W), packed
        U = forest.num_tokens
        x = torch.randn(U, C, requires_grad=True)
        weight, bias = torch.randn(C, W, requires_grad=True), torch.randn(C, requires_grad=True)
        context = torch.randn(context_rows, C, requires_grad=True) if context_rows else None
        leaves = [x, weight, bias] + ([context] if context_rows else [])
        fixups = conv_window_fixups(table, W)
        outs = {}
        for backend in ("torch", "fla"):
            y = tree_causal_conv1d(x, weight, bias, table, "silu", context=context, fixups=fixups, backend=backend)
            outs[backend] = (y.detach(), torch.autograd.grad((y * y).sum(), leaves))
        errors = [rel(outs["fla"][0], outs["torch"][0])] + [rel(a, b) for a, b in zip(outs["fla"][1], outs["torch"][1])]
        print(f"tree conv, fla bulk vs shifted ({U} tokens, {fixups.numel()} fixup rows, {context_rows} context rows): "
              f"out {errors[0]:.1e} grads {max(errors[1:]):.1e}", flush=True)
        worst = max(worst, *errors)
        # bf16 inputs, fp32 weights (autocast): both compute in fp32 and round once, fla without an fp32 copy of x
        xb = x.detach().bfloat16().requires_grad_()
        low = {}
        for backend in ("torch", "fla"):
            y = tree_causal_conv1d(xb, weight, bias, table, "silu", context=context, fixups=fixups, backend=backend)
            assert y.dtype == torch.bfloat16
            low[backend] = (y.detach().float(), torch.autograd.grad((y.float() ** 2).sum(), [xb, weight, bias]))
        low_errors = [rel(low["fla"][0], low["torch"][0])] + [rel(a.float(), b.float())
                                                              for a, b in zip(low["fla"][1], low["torch"][1])]
        print(f"  bf16 x: out {low_errors[0]:.1e} (bit-equal rows {(low['fla'][0] == low['torch'][0]).float().mean():.4f}) "
              f"grads x {low_errors[1]:.1e}, weight {low_errors[2]:.1e}, bias {low_errors[3]:.1e}", flush=True)
        assert max(low_errors) < 1e-2, low_errors
    return worst


def check_fewer_stages(run, leaves) -> None:
    """A serial-pass kernel variant that needs more shared memory than the GPU has (Triton's OutOfResources, as
    a one-sequence forest's variant on the H200) is compiled again with fewer pipelining stages: a stand-in kernel
    refuses the default stages here, and the pass must still give the same outputs and gradients."""
    import torch
    from triton.runtime.errors import OutOfResources

    from harts_hf.kernels.tree_gated_delta_rule import _serial_kernels, fla_backend, serial_state_pass

    fla_backend.BATCH_ROUNDS, fla_backend.STATE_PASS = True, "serial"

    def outputs():
        out = run()
        return out.detach(), torch.autograd.grad(out.square().sum(), leaves)

    expected = outputs()
    originals = {name: getattr(_serial_kernels, name) for name in ("forward_kernel", "backward_kernel")}

    class Refusing:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                if kwargs.get("num_stages", 3) > 2:
                    raise OutOfResources(246280, 232448, "shared memory")
                return self.kernel[grid](*args, **kwargs)
            return launch

    serial_state_pass._STAGES.clear()
    try:
        for name, kernel in originals.items():
            setattr(_serial_kernels, name, Refusing(kernel))
        got = outputs()
    finally:
        for name, kernel in originals.items():
            setattr(_serial_kernels, name, kernel)
    stages = sorted(set(serial_state_pass._STAGES.values()))
    serial_state_pass._STAGES.clear()
    fla_backend.STATE_PASS = "rounds"
    assert stages == [2], stages
    assert torch.equal(got[0], expected[0]) and all(torch.equal(a, b) for a, b in zip(got[1], expected[1]))
    print("serial pass: a variant refused at the default pipelining stages ran again with 2, same outputs and "
          "gradients", flush=True)


def check_model() -> float:
    """A tiny Qwen3-Next through the patched model: tree log-probs and every parameter gradient with the fla
    backend (round-batched node with either state pass ``"auto"`` picks; the mixers whole in the executed layout)
    against the torch backend, on a forest with forks at and around chunk edges. The node's other variants (the
    serial pass's lanes, fla's public function per round), which ``"auto"`` never picks, are checked at the node
    (main()), on the same forest and on planner pieces: a model run of each took a minute here."""
    import torch

    from harts_hf import tree_logprobs
    from tests.forests import chunk_edge_sequences
    from tests.models import VOCAB, build

    model = build("qwen3_next")
    sequences = chunk_edge_sequences(vocab=VOCAB)
    names, params = zip(*[(n, p) for n, p in model.named_parameters() if p.requires_grad])
    from harts_hf.kernels.tree_gated_delta_rule import fla_backend
    from harts_hf.model_patches import gated_deltanet

    results = {}
    for backend, state_pass in (("torch", "rounds"), ("fla", "rounds"), ("fla_serial", "serial"),
                                ("fla_executed", "rounds")):
        fla_backend.BATCH_ROUNDS, fla_backend.STATE_PASS = True, state_pass
        gated_deltanet.EXECUTED_LAYOUT = backend == "fla_executed"  # the mixers whole in the executed layout
        try:
            out = tree_logprobs(model, sequences, gdn_backend=backend.split("_")[0], attention_backend="sdpa")
        finally:
            gated_deltanet.EXECUTED_LAYOUT = False
        weights = [torch.randn(lp.shape, generator=torch.Generator().manual_seed(i)) for i, lp in
                   enumerate(out.logprobs)]
        loss = sum((lp * w).sum() for lp, w in zip(out.logprobs, weights))
        results[backend] = (torch.cat(out.logprobs).detach(), torch.autograd.grad(loss, params, allow_unused=True))
    fla_backend.STATE_PASS = "auto"
    return _against_torch(f"tiny Qwen3-Next, {len(sequences)} sequences", names, results)


def _against_torch(label: str, names, results: dict) -> float:
    """Print and check each run's log-probs and parameter gradients against ``results["torch"]`` (``results``: run
    -> (log-probs, gradients)); the worst log-prob error. The repository's model-level tolerance: A_log / dt_bias
    gradients are sums of cancelling terms whose fp32 rounding alone reaches ~1e-5 (README, "How exact")."""
    worst_values = 0.0
    for run in [name for name in results if name != "torch"]:
        values = rel(results[run][0], results["torch"][0])
        grads = {n: rel(a, b) for n, a, b in zip(names, results[run][1], results["torch"][1])
                 if b is not None and b.norm() > 0}
        worst = max(grads, key=grads.get)
        print(f"model ({label}): {run} vs torch backend: log-probs {values:.1e}, worst parameter gradient "
              f"{grads[worst]:.1e} ({worst})", flush=True)
        assert values < 1e-5 and grads[worst] < 1e-4, (label, run, values, worst, grads[worst])
        worst_values = max(worst_values, values)
    return worst_values


def check_model_backends(family: str, label: str, executed: bool = False) -> float:
    """A tiny patched model through its fla node (Ling 3: Kimi Delta Attention with the safe gate, gated latent
    attention, experts; Nemotron-H: Mamba-2 blocks on the scan's chunks of 64, ``mamba2.CHUNK_SIZE``'s default; both
    through their round-batched nodes): tree log-probs and every parameter gradient with the fla backend
    (``executed``: also with the mixers whole in the executed layout, ``gated_deltanet.EXECUTED_LAYOUT``; the KDA node
    on an executed view is checked in :func:`check_round_node`), against the torch backend."""
    import torch

    from harts_hf import tree_logprobs
    from harts_hf.model_patches import gated_deltanet
    from tests.forests import chunk_edge_sequences
    from tests.models import VOCAB, build

    model = build(family)
    sequences = chunk_edge_sequences(vocab=VOCAB, base_len=140)  # forks at 0, 1, 63-65, 127-129 still
    names, params = zip(*[(n, p) for n, p in model.named_parameters() if p.requires_grad])
    results = {}
    for run in ("torch", "fla", *(("fla_executed",) if executed else ())):  # the mixers whole in the executed layout
        gated_deltanet.EXECUTED_LAYOUT = run == "fla_executed"
        try:
            out = tree_logprobs(model, sequences, gdn_backend="torch" if run == "torch" else "fla",
                                attention_backend="sdpa")
        finally:
            gated_deltanet.EXECUTED_LAYOUT = False
        loss = sum((lp * torch.randn(lp.shape, generator=torch.Generator().manual_seed(i))).sum()
                   for i, lp in enumerate(out.logprobs))
        results[run] = (torch.cat(out.logprobs).detach(), torch.autograd.grad(loss, params, allow_unused=True))
    return _against_torch(f"tiny {label}, {len(sequences)} sequences, forks at chunk edges", names, results)


def check_kept_mixer_outputs() -> None:
    """Tiny Qwen3-Next (Gated DeltaNet), Kimi Linear (KDA) and Nemotron-H (Mamba-2) models under non-reentrant
    checkpointing through their fla round-batched nodes: with ``keep_mixer_outputs`` each node's state pass and output
    stage runs once per layer instead of twice (forward, then the backward's rerun), and the log-probs and every
    parameter gradient are bit-identical to rerunning them."""
    import random

    import torch

    from harts_hf import tree_logprobs
    from harts_hf.kernels.tree_gated_delta_rule import fla_backend, fla_kda, fla_simple_gla
    from harts_hf.model_patches import keep_mixer_outputs
    from harts_hf.trees import PrefixForest
    from tests.forests import random_tree_sequences
    from tests.models import VOCAB, build

    runs = [0]
    bodies = [(fla_backend, "_forward_states_and_output"), (fla_kda, "_forward_body"),
              (fla_simple_gla, "_forward_body")]
    originals = [getattr(module, name) for module, name in bodies]

    def counted(function):
        def body(*args, **kwargs):
            runs[0] += 1
            return function(*args, **kwargs)
        return body

    for (module, name), function in zip(bodies, originals):
        setattr(module, name, counted(function))
    try:
        for family in ("qwen3_next", "kimi_linear", "nemotron_h"):
            model = build(family).train()
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            forest = PrefixForest.from_sequences(random_tree_sequences(random.Random(5), 3, vocab=VOCAB, max_tail=24))
            params = [p for p in model.parameters() if p.requires_grad]
            results, counts = {}, {}
            for keep in (False, True):
                keep_mixer_outputs(model, keep)
                runs[0] = 0
                out = tree_logprobs(model, forest=forest, gdn_backend="fla", attention_backend="sdpa")
                loss = sum((lp * (1 + torch.arange(lp.numel()) % 3)).sum() for lp in out.logprobs)
                results[keep] = (torch.cat(out.logprobs).detach(),
                                 torch.autograd.grad(loss, params, allow_unused=True))
                counts[keep] = runs[0]
            assert counts[False] == 2 * counts[True] > 0, (family, counts)
            assert torch.equal(results[True][0], results[False][0]), family
            for a, b in zip(results[True][1], results[False][1]):
                assert (a is None and b is None) or torch.equal(a, b), family
            print(f"kept mixer outputs (tiny {family}, checkpointed): node bodies run {counts[True]} times against "
                  f"{counts[False]}; log-probs and every parameter gradient bit-identical", flush=True)
    finally:
        for (module, name), function in zip(bodies, originals):
            setattr(module, name, function)


def check_token_ops() -> float:
    """The fused per-token kernels (fla's RMSNorm, gated RMSNorm and SwiGLU; harts_hf's RMSNorm, squared ReLU and
    log-prob / entropy kernels) inside a tiny patched Qwen3-Next, Llama, Nemotron-H and Kimi Linear against the
    references:
    log-probs, entropies and every parameter gradient, the Gated DeltaNet / Mamba-2 / KDA node on the torch backend
    in both runs (Kimi Linear: its all-fp32 sigmoid-gated norm, on fla's gated-norm kernel)."""
    import torch

    from harts_hf import tree_logprobs
    from harts_hf.kernels.logprob_stats import ops as logprob_stats
    from harts_hf.kernels.token_ops import ops as token_ops
    from tests.forests import chunk_edge_sequences
    from tests.models import VOCAB, build

    worst_all = 0.0
    for family in ("qwen3_next", "llama", "nemotron_h", "kimi_linear"):
        model = build(family)
        sequences = chunk_edge_sequences(vocab=VOCAB)
        names, params = zip(*[(n, p) for n, p in model.named_parameters() if p.requires_grad])
        results = {}
        default = token_ops.NORM_KERNEL
        for fused in (False, True, "harts"):  # references; fla's norm kernel; harts_hf's (token_ops.NORM_KERNEL)
            token_ops.BACKEND, logprob_stats.BACKEND = ("fla", "triton") if fused else ("torch", "torch")
            token_ops.NORM_KERNEL = "harts" if fused == "harts" else "fla"
            try:
                out = tree_logprobs(model, sequences, gdn_backend="torch", attention_backend="sdpa",
                                    compute_entropy=True)
            finally:
                token_ops.BACKEND, logprob_stats.BACKEND, token_ops.NORM_KERNEL = "auto", "auto", default
            weights = [torch.randn(lp.shape, generator=torch.Generator().manual_seed(i))
                       for i, lp in enumerate(out.logprobs)]
            loss = sum((lp * w).sum() + 0.1 * (h * w).sum() for lp, h, w in zip(out.logprobs, out.entropies, weights))
            results[fused] = (torch.cat(out.logprobs).detach(), torch.cat(out.entropies).detach(),
                              torch.autograd.grad(loss, params, allow_unused=True))
        for fused, label in ((True, "fla's norm"), ("harts", "harts_hf's norm")):
            values, entropies = rel(results[fused][0], results[False][0]), rel(results[fused][1], results[False][1])
            grads = {n: rel(a, b) for n, a, b in zip(names, results[fused][2], results[False][2])
                     if b is not None and b.norm() > 0}
            worst = max(grads, key=grads.get)
            print(f"fused token ops, {label} ({family}, {len(sequences)} sequences) vs references: log-probs "
                  f"{values:.1e}, entropies {entropies:.1e}, worst parameter gradient {grads[worst]:.1e} ({worst})",
                  flush=True)
            assert values < 1e-5 and entropies < 1e-5 and grads[worst] < 1e-4, (family, label, values, worst)
            worst_all = max(worst_all, values, entropies)
    worst_all = max(worst_all, check_norm_kernel(), check_relu_squared_kernel(), check_group_gated_norm_kernel(),
                    check_kda_gate())
    # whether each label is its row's argmax, over two vocabulary blocks: planted argmaxes, ties before the label
    # (not the first maximum: False, as torch.argmax) and after it (True)
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(48, 5000, generator=generator)
    labels = torch.randint(0, 5000, (48,), generator=generator)
    labels[:16] = logits[:16].argmax(-1)
    for row in range(16, 32):
        labels[row] = 4500 if row < 24 else 100
        logits[row, labels[row]] = logits[row].max() + 1
        logits[row, 4100 if row < 24 else 4900] = logits[row, labels[row]]  # an earlier tie, then a later one
    _, _, top1 = logprob_stats.logprob_entropy(logits, labels, 0.7, backend="triton", return_top1=True)
    expected = logits.argmax(-1) == labels
    assert torch.equal(top1, expected) and 16 < int(expected.sum()) < 48, (top1, expected)
    print(f"fused top-1 flags == torch.argmax on {len(labels)} rows ({int(expected.sum())} top-1, ties included)")
    return worst_all


def check_kda_gate() -> float:
    """Kimi Delta Attention's forget gate on fla's fused kernel (the tree's patched mixer on CUDA) against
    transformers' own gate modules: Kimi Linear's (low-rank projection, softplus) and Ling 3's (one projection, with
    and without its safe gate); the decay and the gradients of the input and of every gate parameter (``A_log``,
    ``dt_bias`` and the projections), fp32."""
    import torch

    from harts_hf.kernels.token_ops import ops as token_ops
    from harts_hf.model_patches.kimi_delta_attention import _FORGET_GATES, _forget_gate
    from tests.models import build

    worst = 0.0
    for family, safe in (("kimi_linear", None), ("bailing_hybrid", True), ("bailing_hybrid", False)):
        gate = next(m for m in build(family).modules() if type(m).__name__ in _FORGET_GATES)
        if safe is not None:
            gate.safe_gate = safe
        x = torch.randn(1, 37, gate.f_a_proj.in_features if hasattr(gate, "f_a_proj") else gate.f_proj.in_features,
                        generator=torch.Generator().manual_seed(0), requires_grad=True)
        params = [x, *gate.parameters()]
        outs = {}
        for backend in ("torch", "fla"):
            token_ops.BACKEND = backend
            try:
                y = _forget_gate(gate, x)
            finally:
                token_ops.BACKEND = "auto"
            w = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
            outs[backend] = (y.detach(), torch.autograd.grad((y * w).sum(), params))
        assert outs["fla"][0].dtype == outs["torch"][0].dtype, (family, outs["fla"][0].dtype)
        errors = [rel(outs["fla"][0], outs["torch"][0])] + \
            [rel(a, b) for a, b in zip(outs["fla"][1], outs["torch"][1])]
        label = family + ("" if safe is None else f", safe gate {safe}")
        print(f"KDA forget gate on fla's kernel ({label}) vs transformers' module: decay {errors[0]:.1e}, "
              f"gradients (input, A_log, dt_bias, projections) {max(errors[1:]):.1e}", flush=True)
        assert max(errors) < 1e-5, (label, errors)
        worst = max(worst, *errors)
    return worst


def check_norm_kernel() -> float:
    """harts_hf's Triton RMSNorm (``token_ops.NORM_KERNEL = "harts"``) against the fp64 reference: output, input and
    weight gradients, both weight forms, widths that are and are not powers of two, row counts that do and do not
    fill the programs' blocks (one row; more rows than the backward has programs)."""
    import torch

    from harts_hf.kernels.token_ops import ops as token_ops
    from harts_hf.kernels.token_ops import rms_norm_reference

    worst = 0.0
    generator = torch.Generator().manual_seed(0)
    for offset, fp32_weight in ((True, True), (False, False), (False, True)):
        for D, N in ((64, 1), (48, 37), (256, 300), (2048, 5)):
            x = torch.randn(N, D, generator=generator, dtype=torch.float64)
            w = 0.5 * torch.randn(D, generator=generator, dtype=torch.float64)
            g = torch.randn(N, D, generator=generator, dtype=torch.float64)
            expected = rms_norm_reference(x.requires_grad_(), w.requires_grad_(), 1e-6, offset=offset,
                                          fp32_weight=fp32_weight)
            want = (expected.detach(), *torch.autograd.grad(expected, (x, w), g))
            x32, w32 = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
            default, token_ops.NORM_KERNEL = token_ops.NORM_KERNEL, "harts"
            try:
                y = token_ops.rms_norm(x32, w32, 1e-6, offset=offset, fp32_weight=fp32_weight, backend="fla")
            finally:
                token_ops.NORM_KERNEL = default
            got = (y.detach(), *torch.autograd.grad(y, (x32, w32), g.float()))
            errors = [rel(a.double(), b) for a, b in zip(got, want)]
            assert y.dtype == torch.float32 and max(errors) < 1e-5, (offset, fp32_weight, D, N, errors)
            worst = max(worst, *errors)
    print(f"harts_hf's Triton RMSNorm vs fp64 reference (offset, plain and fp32-applied weights, widths 48-2048, "
          f"1-300 rows): worst output / gradient error {worst:.1e}")
    return worst


def check_group_gated_norm_kernel() -> float:
    """harts_hf's Triton kernels of Mamba-2's grouped gated norm against the fp64 reference: output and the gradients
    of the input, the gate and the weight, for row counts that do and do not fill a program's rows, 2-8 groups of
    8-64 channels (fp32)."""
    import torch

    from harts_hf.kernels.token_ops import group_gated_rms_norm_reference
    from harts_hf.kernels.token_ops import ops as token_ops

    worst = 0.0
    generator = torch.Generator().manual_seed(0)
    for N, G, S in ((1, 2, 16), (37, 2, 16), (5, 8, 64), (300, 4, 8)):
        x, z, dy = (torch.randn(N, G * S, generator=generator, dtype=torch.float64) for _ in range(3))
        w = 1 + 0.3 * torch.randn(G * S, generator=generator, dtype=torch.float64)
        leaves = [t.requires_grad_() for t in (x, z, w)]
        expected = group_gated_rms_norm_reference(*leaves[:2], leaves[2], 1e-5, S)
        want = (expected.detach(), *torch.autograd.grad(expected, leaves, dy))
        leaves32 = [t.detach().float().requires_grad_() for t in leaves]
        y = token_ops.group_gated_rms_norm(*leaves32[:2], leaves32[2], 1e-5, S, backend="fla")
        got = (y.detach(), *torch.autograd.grad(y, leaves32, dy.float()))
        errors = [rel(a.double(), b) for a, b in zip(got, want)]
        assert y.dtype == torch.float32 and max(errors) < 1e-5, (N, G, S, errors)
        worst = max(worst, *errors)
    print(f"harts_hf's Triton grouped gated norm (Mamba-2) vs fp64 reference (1-300 rows, 2-8 groups of 8-64): worst "
          f"output / gradient error {worst:.1e}")
    return worst


def check_relu_squared_kernel() -> float:
    """harts_hf's Triton squared ReLU against the fp64 reference: output and input gradient in fp32 (sizes below,
    at and past one program's block, zeros and negatives included), and in bf16 within one bf16 step of the
    reference computed in fp32 (Triton's interpreter rounds fp32 to bf16 toward zero, the GPU to nearest; on the GPU
    ``benchmarks/gpu_kernels.py --ops token`` compares the rounded values)."""
    import torch

    from harts_hf.kernels.token_ops import ops as token_ops
    from harts_hf.kernels.token_ops import relu_squared_reference

    worst = 0.0
    generator = torch.Generator().manual_seed(0)
    for shape in ((1,), (3, 5), (2, 4096), (3, 4097)):
        x = torch.randn(shape, generator=generator, dtype=torch.float64)
        x.view(-1)[: x.numel() // 4] = 0.0
        g = torch.randn(shape, generator=generator, dtype=torch.float64)
        expected = relu_squared_reference(x.requires_grad_())
        want = (expected.detach(), torch.autograd.grad(expected, x, g)[0])
        x32 = x.detach().float().requires_grad_()
        y = token_ops.relu_squared(x32, backend="fla")
        got = (y.detach(), torch.autograd.grad(y, x32, g.float())[0])
        errors = [rel(a.double(), b) for a, b in zip(got, want)]
        assert y.dtype == torch.float32 and max(errors) < 1e-6, (shape, errors)
        worst = max(worst, *errors)
        xb, gb = x.detach().bfloat16().requires_grad_(), g.bfloat16()
        yb = token_ops.relu_squared(xb, backend="fla")
        (dxb,) = torch.autograd.grad(yb, xb, gb)
        for got_b, want_f in ((yb, relu_squared_reference(xb.detach().float())),
                              (dxb, 2 * torch.relu(xb.detach().float()) * gb.float())):
            assert got_b.dtype == torch.bfloat16 and bool(
                ((got_b.float() - want_f).abs() <= want_f.abs() * 2 ** -7).all()), shape
    print(f"harts_hf's Triton squared ReLU vs fp64 reference (1-12,291 elements): worst output / gradient error "
          f"{worst:.1e}; bf16 within one bf16 step of the fp32 reference")
    return worst


def check_gather_rows() -> float:
    """harts_hf's Triton sum of gathered rows' gradients (``varlen.GATHER_SUM = "rows"``) against an fp64 scatter-add:
    the key index of a forest with forks and context rows (rows with many copies, rows with one, rows with none),
    widths below, at and past one program's column block, strided gradients (a padded head's slice, transposed
    heads, 2-d and 4-d rows) read in place, sums added into an fp32 total; fp32 through ``gather_rows``' backward,
    and bf16 within one bf16 step of the fp32 sum (the interpreter rounds toward zero)."""
    import torch

    from harts_hf.kernels.tree_attention import varlen
    from harts_hf.trees import PrefixForest
    from tests.forests import chunk_edge_sequences

    packed = PrefixForest.from_sequences(chunk_edge_sequences()).pack()
    layout = varlen.build_varlen_layout(packed, context_tokens=3)
    index = layout.key_index
    num_rows = packed.num_tokens + 3 + 2  # two rows no run gathers
    worst = 0.0
    generator = torch.Generator().manual_seed(0)
    default = varlen.GATHER_SUM
    try:
        for heads, dim in ((2, 8), (4, 256), (3, 700)):
            x = torch.randn(num_rows, heads, dim, generator=generator, requires_grad=True)
            g = torch.randn(index.shape[0], heads, dim, generator=generator)
            want = torch.zeros(num_rows, heads, dim, dtype=torch.float64).index_add_(0, index, g.double())
            varlen.GATHER_SUM = "rows"
            (got,) = torch.autograd.grad(varlen.gather_rows(x, index), x, g)
            error = rel(got.double(), want)
            assert got.dtype == torch.float32 and error < 1e-6 and not got[-2:].any(), (heads, dim, error)
            worst = max(worst, error)
            gb = g.bfloat16()
            got_b = varlen.sum_gathered_rows(gb, index, num_rows, torch.bfloat16)
            want_f = torch.zeros(num_rows, heads, dim).index_add_(0, index, gb.float())
            assert got_b.dtype == torch.bfloat16 and bool(
                ((got_b.float() - want_f).abs() <= want_f.abs() * 2 ** -7 + 1e-30).all()), (heads, dim)
        # strided gradients read in place: a value head padded to the key width and sliced back (flash's dv), heads
        # and dims transposed, rows of one dimension, and a 4-d gradient (its middle dimensions merged)
        wide = torch.randn(index.shape[0], 4, 40, generator=generator)
        views = (wide[..., :24], wide.transpose(1, 2), wide[:, 1], wide.view(index.shape[0], 2, 2, 40)[:, :, :, 3:30])
        for g in views:
            want = torch.zeros(num_rows, *g.shape[1:], dtype=torch.float64).index_add_(0, index, g.double())
            got = varlen.sum_gathered_rows(g, index, num_rows, torch.float32)
            error = rel(got.double(), want)
            assert got.shape == want.shape and error < 1e-6, (tuple(g.shape), g.stride(), error)
            worst = max(worst, error)
        # added into an fp32 total (the shared-keys path's per-call sums): the same kernel, each row plus its value
        g = torch.randn(index.shape[0], 3, 40, generator=generator)
        start = torch.randn(num_rows, 3, 40, generator=generator)
        want = start.double().index_add_(0, index, g.double())
        got = varlen.add_rows(start.clone(), index, g)
        error = rel(got.double(), want)
        assert error < 1e-6, error
        worst = max(worst, error)
        assert varlen._copies_of_rows(index, num_rows)[0] is varlen._COPIES.get(index)[1]  # listed once, reused
    finally:
        varlen.GATHER_SUM = default
    print(f"harts_hf's Triton sum of gathered rows vs an fp64 scatter-add ({index.shape[0]} copies of {num_rows} rows, "
          f"up to {int(torch.bincount(index).max())} each): worst error {worst:.1e}; bf16 within one bf16 step")
    return worst


if __name__ == "__main__":
    main()
