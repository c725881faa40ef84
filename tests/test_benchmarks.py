"""The GPU benchmark suite's model stages run end to end on the CPU (a tiny model), so a broken stage shows here
and not in the device minutes of a GPU session."""

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_suite_model_stages_on_cpu(tmp_path):
    run = subprocess.run(
        [sys.executable, "benchmarks/gpu_suite.py", "--device", "cpu", "--model", "tiny", "--workloads", "swe:0.002",
         "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads((tmp_path / "gpu_suite.json").read_text())
    assert not [key for key in results if key.endswith("_error")], run.stdout[-3000:]
    stages = results["stages"]
    assert [s.split(":")[0] for s in stages] == ["parity", "kernels", "warmup", "cost_fit", "swe", "profile",
                                                 "padded"], stages
    assert "parity: not run on cpu" in stages and "kernels: not run on cpu" in stages
    row = results["workloads"]["swe@0.002"]
    for path in ("tree", "packed", "loop", "padded"):
        assert row[path]["seconds"] > 0, path
    assert row["stats"]["R_tok"] > 1 and row["S_phys"] > 1 and row["loop_model_seconds"] > 0
    assert results["warmup"]["loop_length_classes"] >= 1 and results["warmup"]["padded_shape_classes"] >= 1
    assert "| swe@0.002 |" in run.stdout
    assert row["baseline"] in ("packed", "loop", "padded") and row["tree_rate_vs_plain"] > 0
    # the stricter limit counts the per-call cost as each baseline pays it (the tree once, the loop per trajectory)
    with_calls = row["S_phys_with_calls"]
    assert set(with_calls) == {"packed", "loop", "padded"} and with_calls["loop"] >= with_calls["packed"] > 0
    assert 0 < row["fraction_of_S_phys_with_calls"] < float("inf")
    families = results["profile"]["cpu_seconds_by_family"]
    assert set(families) == {"tree", "packed"} and all(sum(f.values()) > 0 for f in families.values())
    assert (tmp_path / "profile_tree.txt").read_text().count("\n") > 10


def test_plan_memory_probe_per_trajectory_sample_on_cpu():
    """plan_memory_probe's per-trajectory baseline (each trajectory alone through the same kernels, for lengths
    where the unpatched model's full logits do not fit) picks quantiles or all trajectories and prices them."""
    import random

    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_tree_vs_trajectory import build_model
    from plan_memory_probe import loop_sample

    model = build_model("tiny", "qwen3_next", torch.device("cpu"), torch.float32)
    rng = random.Random(0)
    sequences = [[rng.randrange(1000) for _ in range(n)] for n in (30, 50, 70, 90, 110)]
    fit = (0.1, 1e-4, 1e-9)
    some = loop_sample(model, sequences, 2, torch.device("cpu"), fit)
    assert not some["all"] and [r["length"] for r in some["trajectories"]] == [30, 90]  # quantiles 0.1 and 0.9
    every = loop_sample(model, sequences, -1, torch.device("cpu"), fit)
    assert every["all"] and every["measured_seconds"] > 0
    assert abs(every["priced_seconds"] - every["whole_loop_priced_seconds"]) < 1e-9


def test_plan_memory_probe_prices_the_tree_at_the_packed_paths_rates():
    """packed_fit recovers c + a tokens + b pairs from the packed calls and prices the forest (one call over its
    unique tokens and tree pairs) with it; S_phys_packed = the calls' seconds / that price."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from plan_memory_probe import packed_fit

    from harts_hf.trees import PrefixForest

    prompt = list(range(1, 41))
    sequences = [prompt + [100 + i] * n for i, n in enumerate((10, 30, 50, 70, 90, 110))]
    c, a, b = 0.2, 5e-5, 2e-9
    groups = [sequences[:2], sequences[2:3], sequences[3:5], sequences[5:]]
    rows = []
    for group in groups:
        tokens, pairs = sum(map(len, group)), sum(len(s) * (len(s) + 1) / 2 for s in group)
        rows.append(dict(tokens=tokens, pairs=pairs, seconds=c + a * tokens + b * pairs))
    result = packed_fit(rows, sequences)
    assert max(abs(x - y) / y for x, y in zip(result["fit"], (c, a, b))) < 1e-6
    stats = PrefixForest.from_sequences(sequences).pack().stats()
    price = c + a * stats["unique_tokens"] + b * stats["tree_attention_pairs"]
    assert abs(result["tree_priced_seconds"] - price) < 1e-12
    assert abs(result["S_phys_packed"] - sum(r["seconds"] for r in rows) / price) < 1e-9
    assert math.isnan(packed_fit(rows[:2], sequences)["S_phys_packed"])  # two calls: c, a, b undetermined


def test_module_breakdown_gives_every_op_to_one_part_on_cpu():
    """module_breakdown: a tree forward+backward (tiny model, gradient checkpointing) profiled under ``labelled``;
    every op's own time lands in exactly one part and phase (their sum is the profile's), the GDN kernel, tree conv,
    attention kernel, MLP and head get forward and backward time, checkpointing's recomputed forwards are told
    apart, and the hooks and wrappers are gone afterwards."""
    import random

    import torch
    from torch.profiler import ProfilerActivity, profile

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_tree_vs_trajectory import build_model, run_tree
    from module_breakdown import PREFIX, attribute, labelled, table

    import harts_hf.model_patches.gated_deltanet as gdn_patch
    from harts_hf.trees import PrefixForest

    model = build_model("tiny", "qwen3_next", torch.device("cpu"), torch.float32)
    rng = random.Random(0)
    prompt = [rng.randrange(1, 500) for _ in range(70)]
    forest = PrefixForest.from_sequences([prompt + [rng.randrange(1, 500) for _ in range(n)] for n in (20, 45, 90)])
    run_tree(model, forest)  # patches the model (first use) outside the profile
    original = gdn_patch.tree_gated_delta_rule

    def hooks():
        return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())

    before = hooks()
    with labelled(model), profile(activities=[ProfilerActivity.CPU]) as prof:
        run_tree(model, forest)
    assert gdn_patch.tree_gated_delta_rule is original and hooks() == before
    events = prof.events()
    parts = attribute(events, on_cuda=False)
    own = sum(e.self_cpu_time_total for e in events if e.device_type == torch.autograd.DeviceType.CPU) / 1e6
    assert abs(sum(sum(p.values()) for p in parts.values()) - own) < 1e-6 * max(own, 1.0)
    for part in ("gdn_kernel", "conv", "attention_kernel", "mlp", "head"):
        assert parts[part]["forward"] > 0 and parts[part]["backward"] > 0, (part, parts[part])
    # layers are checkpointed; the head's rows fit one chunk here, which it does not checkpoint
    assert parts["mlp"]["recompute"] > 0 and parts["head"]["recompute"] == 0
    # the decoder layers' own norms are a part: their recomputation is told apart from the backward
    assert parts["layer_norms"]["forward"] > 0 and parts["layer_norms"]["recompute"] > 0
    assert {"gdn_layer", "attention_layer", "other"} <= set(parts)
    assert {e.name for e in events if e.name.startswith(PREFIX)} == {PREFIX + p for p in parts if p != "other"}
    assert "gdn_kernel" in table(parts, tokens=forest.pack().num_tokens)


def test_run_tree_accumulates_gradients_when_asked():
    """The packed baseline's calls accumulate gradients as a trainer's microbatches do (run_tree(zero_grad=False)),
    so its peak memory counts them; the default starts from none."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_tree_vs_trajectory import build_model, run_tree

    from harts_hf.trees import PrefixForest

    model = build_model("tiny", "qwen3_next", torch.device("cpu"), torch.float32)
    forest = PrefixForest.from_sequences([[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8]])
    run_tree(model, forest)
    once = [p.grad.clone() for p in model.parameters()]
    run_tree(model, forest, zero_grad=False)
    assert all(torch.allclose(p.grad, 2 * g, rtol=1e-5, atol=1e-7) for p, g in zip(model.parameters(), once))
    run_tree(model, forest)
    assert all(torch.allclose(p.grad, g, rtol=1e-5, atol=1e-7) for p, g in zip(model.parameters(), once))


def test_module_breakdown_counts_device_time_once():
    """On CUDA (events built by hand as Kineto's parse gives them): a kernel's time is its launching op's own device
    time; the GPU-side spans of the ``record_function`` ranges are not kernels; a checkpointed layer's norm recomputed
    in a backward node goes to ``layer_norms``' recompute; a backward op counts as its node's part's backward whatever
    sequence number it carries (on the H200 they carried some); kernels no op claims are ``unattributed``."""
    from types import SimpleNamespace

    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from module_breakdown import attribute

    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    start = iter(range(100))

    def event(name, parent=None, seq=-1, device_s=0.0, device=cpu, annotation=False, fwd_thread=1):
        return SimpleNamespace(name=name, key=name, cpu_parent=parent, sequence_nr=seq, thread=1,
                               fwd_thread=fwd_thread, time_range=SimpleNamespace(start=next(start)),
                               self_device_time_total=device_s * 1e6, self_cpu_time_total=0.0, device_type=device,
                               is_user_annotation=annotation)

    mlp = event("harts::mlp")
    linear = event("aten::linear", mlp, seq=5)
    mm = event("aten::mm", linear, seq=5, device_s=2.0)
    node = event("autograd::engine::evaluate_function: MmBackward0", seq=5)
    mm_backward = event("aten::mm", node, device_s=3.0)
    numbered = event("aten::mul", event("aten::mul", node, seq=12), seq=12, device_s=0.25)  # a backward op, numbered
    layer = event("harts::layer_norms", node)
    norm = event("aten::mul", layer, seq=9, device_s=0.5)  # a checkpointed layer's norm, recomputed
    kernels = [event(f"kernel{i}", device=cuda, device_s=s) for i, s in enumerate((2.0, 3.0, 0.25, 0.5, 1.0))]
    span = event("harts::mlp", device=cuda, device_s=10.0, annotation=True)
    parts = attribute([mlp, linear, mm, node, mm_backward, numbered, layer, norm, *kernels, span], on_cuda=True)
    assert parts["mlp"] == {"forward": 2.0, "recompute": 0.0, "backward": 3.25}
    assert parts["layer_norms"] == {"forward": 0.0, "recompute": 0.5, "backward": 0.0}
    assert parts["total"] == 6.75 and parts["unattributed"]["forward"] == 1.0
