"""The GPU benchmark suite's model stages run end to end on the CPU (a tiny model), so a broken stage shows here
and not in the device minutes of a GPU session. These runs share CI's loaded 2-core machine: what they measure, and
everything fitted or derived from it, is checked for shape and sanity only (present, a finite float >= 0, or None
where a fit leaves it undefined), never for its size; token counts and priced values from given fits are exact."""

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def is_finite_nonnegative(value) -> bool:
    """A measured time, or a value fitted or derived from measured times: a finite float >= 0, whatever its size."""
    return isinstance(value, float) and math.isfinite(value) and value >= 0


def is_finite_nonnegative_or_none(value) -> bool:
    """As :func:`is_finite_nonnegative`, or None where the benchmark reports a degenerate fit as undefined."""
    return value is None or is_finite_nonnegative(value)


def test_gpu_suite_model_stages_on_cpu(tmp_path):
    run = subprocess.run(
        [sys.executable, "benchmarks/gpu_suite.py", "--device", "cpu", "--model", "tiny", "--workloads", "swe:0.002",
         "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads((tmp_path / "gpu_suite.json").read_text())
    assert not [key for key in results if key.endswith("_error")], run.stdout[-3000:]
    assert json.loads((tmp_path / "run.json").read_text())["command"].startswith("gpu_suite.py --device cpu")
    stages = results["stages"]
    assert [s.split(":")[0] for s in stages] == ["parity", "kernels", "warmup", "cost_fit", "swe", "profile",
                                                 "padded"], stages
    assert "parity: not run on cpu" in stages and "kernels: not run on cpu" in stages
    fit = results["cost_fit"]
    assert all(math.isfinite(fit[key]) for key in ("c_seconds_per_call", "a_seconds_per_token", "b_seconds_per_pair"))
    assert list(fit["times"]) == ["64", "128", "256", "512"] and all(map(is_finite_nonnegative, fit["times"].values()))
    row = results["workloads"]["swe@0.002"]
    for path in ("tree", "packed", "loop", "padded"):
        assert is_finite_nonnegative(row[path]["seconds"]), (path, row[path])
        throughput = row[path]["throughput"]  # model FLOPs of the path's work, exact; MFU from its seconds
        assert throughput["model_flops"] > 0 and all(map(is_finite_nonnegative_or_none, (throughput["mfu"],
                                                                                         throughput["hfu"])))
    assert row["flop_ratio"] > 1 and row["packed"]["throughput"]["model_flops"] == row["tree"]["throughput"]["path_flops"]
    # the forest's statistics are token counts: exact, whatever the timings
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_tree_vs_trajectory import workload_sequences

    from harts_hf.trees import PrefixForest

    forest = PrefixForest.from_sequences(workload_sequences("swe", 0.002, 1024)).pack().stats()
    for key in ("sequences", "path_tokens", "unique_tokens", "tree_attention_pairs", "R_tok", "R_att"):
        assert row["stats"][key] == forest[key], key
    assert row["stats"]["R_tok"] > 1 and row["stats"]["R_att"] > 1
    # the rest comes from the cost fit over this machine's timings: present and sane, its size unchecked
    assert is_finite_nonnegative(row["loop_model_seconds"]) and is_finite_nonnegative(row["tree_physical_seconds"])
    assert is_finite_nonnegative_or_none(row["S_phys"])
    assert row["S_phys"] is not None or isinstance(row["S_phys_undefined"], str)
    with_calls = row["S_phys_with_calls"]
    assert set(with_calls) == {"packed", "loop", "padded"}
    assert all(map(is_finite_nonnegative_or_none, with_calls.values())), with_calls
    assert row["baseline"] in ("packed", "loop", "padded") and is_finite_nonnegative(row["speedup_vs_strongest"])
    for key in ("fraction_of_S_phys", "fraction_of_S_phys_with_calls", "tree_rate_vs_plain"):
        assert is_finite_nonnegative_or_none(row[key]), (key, row[key])
    warmup = results["warmup"]
    assert warmup["loop_length_classes"] >= 1 and warmup["padded_shape_classes"] >= 1
    assert all(is_finite_nonnegative(value) for key, value in warmup.items() if key.endswith("_s"))
    assert "| swe@0.002 |" in run.stdout
    families = results["profile"]["cpu_seconds_by_family"]
    assert set(families) == {"tree", "packed"}
    assert all(f and all(map(is_finite_nonnegative, f.values())) for f in families.values()), families
    assert (tmp_path / "profile_tree.txt").read_text().count("\n") > 10


def test_physical_limits_from_a_given_fit():
    """S_phys and S_phys_with_calls from token counts and a given fit (no timing): the tree's unique work against
    every trajectory's, the per-call cost counted once for packed, per trajectory for the loop and per micro-batch
    for padded. A fit with a = b = 0 (times that did not grow with length, as on a loaded CPU) leaves S_phys and the
    fractions of it undefined (None, with the reason) instead of NaN."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_tree_vs_trajectory import physical_limits, score

    from harts_hf.trees import PrefixForest

    prompt = list(range(1, 41))
    sequences = [prompt + [100 + i] * n for i, n in enumerate((10, 30, 50))]
    stats = PrefixForest.from_sequences(sequences).pack().stats()
    lengths = [len(s) for s in sequences]
    c, a, b = 0.2, 5e-5, 2e-9
    work = a * sum(lengths) + b * sum(n * n / 2 for n in lengths)
    tree = a * stats["unique_tokens"] + b * stats["tree_attention_pairs"]
    limits = physical_limits(lengths, stats, c, a, b, micro_batch=2)
    assert limits["S_phys"] == pytest.approx(work / tree, rel=1e-12) and limits["S_phys"] > 1
    assert limits["loop_model_seconds"] == pytest.approx(3 * c + work, rel=1e-12)
    assert limits["tree_physical_seconds"] == pytest.approx(tree, rel=1e-12) and "S_phys_undefined" not in limits
    calls = {"packed": 1, "loop": 3, "padded": 2}  # 3 trajectories, micro-batches of 2
    assert limits["S_phys_with_calls"] == pytest.approx(
        {key: (n * c + work) / (c + tree) for key, n in calls.items()}, rel=1e-12)
    row = score({"tree": {"seconds": 0.5}, "packed": {"seconds": 2.0}, "loop": {"seconds": 3.0}, **limits})
    assert row["baseline"] == "packed" and row["speedup_vs_strongest"] == 4.0
    assert row["fraction_of_S_phys"] == pytest.approx(4.0 / limits["S_phys"], rel=1e-12)
    assert row["tree_rate_vs_plain"] == pytest.approx(tree / 0.5, rel=1e-12)

    flat = physical_limits(lengths, stats, 0.3, 0.0, 0.0, micro_batch=2)
    assert flat["S_phys"] is None and "a = 0, b = 0" in flat["S_phys_undefined"]
    assert flat["S_phys_with_calls"] == pytest.approx({"packed": 1.0, "loop": 3.0, "padded": 2.0})
    row = score({"tree": {"seconds": 0.5}, "packed": {"seconds": 2.0}, **flat})
    assert row["fraction_of_S_phys"] is None and row["tree_rate_vs_plain"] is None
    assert row["fraction_of_S_phys_with_calls"] == pytest.approx(4.0)
    nothing = physical_limits(lengths, stats, 0.0, 0.0, 0.0, micro_batch=2)
    assert set(nothing["S_phys_with_calls"].values()) == {None}
    assert score({"tree": {"seconds": 0.5}, **nothing})["fraction_of_S_phys_with_calls"] is None


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
    assert every["all"] and is_finite_nonnegative(every["measured_seconds"])
    assert all(is_finite_nonnegative(r["seconds"]) for r in every["trajectories"])
    assert abs(every["priced_seconds"] - every["whole_loop_priced_seconds"]) < 1e-9


def test_plan_memory_probe_interleaves_one_setting_with_the_packed_path(capsys):
    """--interleave alternates the tree's runs with packed passes: it refuses several settings or no packed path,
    naming the flags, and merge_passes lays the passes out as one packed result with a run per pass."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from packed_path import merge_passes
    from plan_memory_probe import main

    for argv, named in ((["--kernels", "fused", "fused_fa4", "--packed-groups", "0"], "--kernels"),
                        (["--budget", "0", "65536", "--packed-groups", "0"], "--budget"),
                        (["--budget", "0"], "--packed-groups")):
        with pytest.raises(SystemExit):
            main(["--interleave", *argv])
        assert named in capsys.readouterr().err
    sequences = [[1, 2, 3, 4], [1, 2, 5], [6, 7, 8, 9, 10]]
    calls = [dict(trajectories=2, tokens=7, pairs=16.0), dict(trajectories=1, tokens=5, pairs=15.0)]
    passes = [dict(calls=2, max_tokens=8, seconds=a + b, repeat_seconds=[a + b], peak_gib=peak,
                   groups=[dict(calls[0], seconds=a, seconds_all=[a], peak_gib=peak, alloc_retries=retries),
                           dict(calls[1], seconds=b, seconds_all=[b], peak_gib=1.0, alloc_retries=0)])
              for a, b, peak, retries in ((1.0, 2.0, 3.0, 1), (1.5, 2.5, 4.0, 2))]
    merged = merge_passes(passes, sequences)
    assert merged["repeat_seconds"] == [3.0, 4.0] and merged["seconds"] == pytest.approx(3.5)
    assert [g["seconds_all"] for g in merged["groups"]] == [[1.0, 1.5], [2.0, 2.5]]
    assert merged["peak_gib"] == 4.0 and merged["groups"][0]["peak_gib"] == 4.0
    assert merged["alloc_retries"] == 3 and [g["alloc_retries"] for g in merged["groups"]] == [3, 0]


def test_plan_memory_probe_warms_up_at_the_largest_piece_that_fits(monkeypatch):
    """The warm-up runs the largest piece size asked for (0: the whole forest), passing to the next size when one
    runs out of memory, and raises only when none fits."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import plan_memory_probe

    tried = []

    def run(model, sequences, budget, device, **options):
        tried.append(budget)
        if budget is None or budget > 40000:
            raise torch.OutOfMemoryError("out of memory")
        return dict(seconds=1.0)

    monkeypatch.setattr(plan_memory_probe, "run", run)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    model = torch.nn.Linear(1, 1)
    args = argparse.Namespace(budget=[32768, 0, 65536], attention="auto", no_recompute=False)
    assert plan_memory_probe.warm_up(model, [], args, torch.device("cpu")) == dict(seconds=1.0)
    assert tried == [None, 65536, 32768]
    args.budget = [0]
    with pytest.raises(torch.OutOfMemoryError):
        plan_memory_probe.warm_up(model, [], args, torch.device("cpu"))


def test_plan_memory_probe_takes_a_scale_per_workload(capsys):
    """--workload NAME[:SCALE]: each workload may carry its own scale (one process, kernels compiled once); an unknown
    name or a scale that is not a positive number is refused, naming the item and the fix."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from plan_memory_probe import workload_spec

    assert workload_spec("tau") == ("tau", None) and workload_spec("tau:0.02") == ("tau", 0.02)
    for bad, named in (("taux", "pick one of swe, tau"), ("tau:0", "positive number"), ("tau:x", "tau:0.02")):
        with pytest.raises(argparse.ArgumentTypeError, match=named):
            workload_spec(bad)


def test_plan_memory_probe_measures_each_ranks_pieces():
    """replica_balance runs the planner's placement for several ranks here, piece by piece, and gives each rank the
    seconds between the executor's marks of its pieces: the ranks' seconds add up to the call's (nothing counted
    twice, nothing lost but the result's assembly), next to the cost model's prediction per rank."""
    import random

    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_tree_vs_trajectory import build_model
    from rank_balance import replica_balance

    from harts_hf.trees import PrefixForest

    model = build_model("tiny", "qwen3_next", torch.device("cpu"), torch.float32)
    rng = random.Random(0)
    prompt = [rng.randrange(1000) for _ in range(40)]
    sequences = [prompt + [rng.randrange(1000) for _ in range(n)] for n in (30, 50, 70, 90, 110, 60)]
    row = replica_balance(model, sequences, 120, 2, torch.device("cpu"), runs=1)
    assert row["replicas"] == 2 and len(row["measured_seconds"]) == len(row["predicted_seconds"]) == 2
    assert row["pieces"] == len(row["piece_seconds"]) > 2 and all(x > 0 for x in row["piece_seconds"])
    assert all(x > 0 for x in row["measured_seconds"])
    assert sum(row["replica_tokens"]) == PrefixForest.from_sequences(sequences).pack().num_tokens
    assert sum(row["measured_seconds"]) + row["unattributed_seconds"] == pytest.approx(row["total_seconds"])
    assert row["measured_imbalance"] >= 1.0 and row["predicted_imbalance"] >= 1.0
    assert all(p.grad is None for p in model.parameters())  # left as it found them


def test_plan_memory_probe_prices_the_tree_at_the_packed_paths_rates():
    """packed_fit recovers c + a tokens + b pairs from the packed calls and prices the forest (one call over its
    unique tokens and tree pairs) with it; S_phys_packed = the calls' seconds / that price."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from packed_path import packed_fit

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
    attention kernel, MLP and head get forward and backward ops, checkpointing's recomputed forwards are told
    apart, and the hooks and wrappers are gone afterwards. Which part gets an op is checked on op counts (each op
    priced 1 us), not on the profiled times, which a loaded machine can make anything."""
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

    class OneMicrosecond:
        """A profiled event whose own CPU time reads 1 us: attributed, the parts count ops."""

        self_cpu_time_total = 1.0

        def __init__(self, event):
            self.event = event

        def __getattr__(self, name):
            return getattr(self.event, name)

    ops = sum(e.device_type == torch.autograd.DeviceType.CPU for e in events)
    parts = attribute([OneMicrosecond(e) for e in events], on_cuda=False)
    assert round(sum(sum(p.values()) for p in parts.values()) * 1e6) == ops  # every op in exactly one part
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


def test_packed_path_times_a_slice_of_its_calls(capsys):
    """--packed-calls START:STOP times only those calls of the packed path (as --packed-groups cuts them), each row
    with its index, so that a path too long for one process can be timed in parts; a bad range names the flag."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_tree_vs_trajectory import build_model
    from packed_path import consecutive_groups, packed_groups
    from plan_memory_probe import call_range, main

    model = build_model("tiny", "qwen3_next", torch.device("cpu"), torch.float32)
    sequences = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [9, 10, 11], [12, 13, 14, 15], [16, 17]]
    assert [len(group) for group in consecutive_groups(sequences, 8)] == [1, 2, 2]
    part = packed_groups(model, sequences, 8, torch.device("cpu"), warmup="first", calls=call_range("1:3"))
    assert [row["call"] for row in part["groups"]] == [1, 2] and part["call_range"] == [1, 3]
    assert part["groups"][0]["first_seconds"] is not None and part["groups"][1]["first_seconds"] is None
    assert [row["tokens"] for row in part["groups"]] == [8, 6]
    assert [row["call"] for row in packed_groups(model, sequences, 8, torch.device("cpu"),
                                                 calls=call_range("2:"))["groups"]] == [2]
    with pytest.raises(ValueError, match="no packed call"):
        packed_groups(model, sequences, 8, torch.device("cpu"), calls=call_range("3:"))
    with pytest.raises(SystemExit):
        main(["--packed-calls", "7", "--packed-groups", "0"])
    assert "--packed-calls '7'" in capsys.readouterr().err


def test_packed_parts_join_into_the_whole_path(tmp_path, capsys):
    """--join-packed (no GPU): the rows of --packed-calls runs joined into the whole packed path, with its MFU and the
    speed-up and fraction of a tree run given by --join-tree; a missing call or another workload's call is named."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from packed_path import consecutive_groups
    from plan_memory_probe import MODELS, main, task_sequences

    sequences = task_sequences(0.02, MODELS["tiny"]["vocab_size"], workload="tau")
    groups = consecutive_groups(sequences, 4096)
    rows = [dict(call=i, trajectories=len(g), tokens=sum(map(len, g)), pairs=sum(len(x) * (len(x) + 1) / 2 for x in g),
                 seconds=1.0 + i, seconds_all=[0.5 + i, 1.5 + i], first_seconds=None, peak_gib=2.0 + i % 2,
                 reserved_gib=4.0, alloc_retries=0) for i, g in enumerate(groups)]
    assert len(rows) >= 4
    for name, part in (("a", rows[:2]), ("b", rows[2:])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "probe_packed_calls.json").write_text(json.dumps(part))
    tree = tmp_path / "tree.json"
    tree.write_text(json.dumps([dict(budget=None, pieces=1, seconds=2.0, keep_attention="on", checkpointed_layers=[],
                                     peak_gib=1.0)]))
    common = ["--model", "tiny", "--workload", "tau", "--scale", "0.02", "--packed-groups", "4096"]
    joined = main([*common, "--join-packed", str(tmp_path / "b"), str(tmp_path / "a"), "--join-tree", str(tree),
                   "--out", str(tmp_path / "out")])
    packed = joined[-1]["packed_groups"]
    assert [g["call"] for g in packed["groups"]] == list(range(len(rows))) and packed["calls"] == len(rows)
    assert packed["seconds"] == sum(1.0 + i for i in range(len(rows)))
    assert packed["repeat_seconds"] == [sum(0.5 + i for i in range(len(rows))), sum(1.5 + i for i in range(len(rows)))]
    assert packed["peak_gib"] == 3.0 and 0 < packed["throughput"]["mfu"]
    assert joined[0]["speedup_vs_packed"] == packed["seconds"] / 2.0 and joined[0]["fraction_of_flop_ratio"] > 0
    assert json.loads((tmp_path / "out" / "probe.json").read_text())[-1]["packed_groups"]["seconds"] == packed["seconds"]
    with pytest.raises(ValueError, match="run the missing ones with --packed-calls"):
        main([*common, "--join-packed", str(tmp_path / "b"), "--out", str(tmp_path / "out")])
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "probe_packed_calls.json").write_text(json.dumps([dict(rows[2], tokens=rows[2]["tokens"] + 1),
                                                                        *rows[3:]]))
    with pytest.raises(ValueError, match="not the same workload"):
        main([*common, "--join-packed", str(tmp_path / "a"), str(tmp_path / "c"), "--out", str(tmp_path / "out")])
    other = tmp_path / "other_tree.json"
    other.write_text(json.dumps([dict(budget=None, pieces=1, seconds=2.0, unique_tokens=7, peak_gib=1.0)]))
    with pytest.raises(ValueError, match="not the same workload or scale"):
        main([*common, "--join-packed", str(tmp_path / "a"), str(tmp_path / "b"), "--join-tree", str(other),
              "--out", str(tmp_path / "out")])
    with pytest.raises(SystemExit):
        main([*common, "--join-tree", str(tree)])
    assert "--join-tree goes with --join-packed" in capsys.readouterr().err
    # no --workload: the default (one `swe` task) is read as the parsed items are (it once failed to unpack)
    with pytest.raises(ValueError, match="run the missing ones with --packed-calls"):
        main(["--model", "tiny", "--scale", "0.02", "--packed-groups", "4096", "--join-packed", str(tmp_path / "a"),
              "--out", str(tmp_path / "out")])


@pytest.mark.parametrize("family, mixer, norms", [
    ("qwen3_next", "Qwen3NextGatedDeltaNet", 2), ("kimi_linear", "KimiLinearDeltaAttention", 2),
    ("nemotron_h", "NemotronHMamba2Mixer", 1), ("bamba", "BambaMixer", 2),
    ("granitemoehybrid", "GraniteMoeHybridMambaLayer", 2)])
def test_module_breakdown_names_every_familys_parts(family, mixer, norms):
    """Each family's linear-recurrence mixer is a ``gdn_layer`` (Kimi Delta Attention's class ends in "Attention" too),
    its softmax attention an ``attention_layer``, its feed-forward blocks (MoE ones included) ``mlp``, and the norms of
    its decoder layers (Nemotron-H's are "Block"s, one norm each) ``layer_norms``."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from module_breakdown import LAYER_NORMS, _part_of_module

    from tests.models import build

    model = build(family)
    parts = {type(m).__name__: _part_of_module(m) for m in model.modules()}
    assert parts[mixer] == "gdn_layer"
    assert {part for name, part in parts.items() if name.endswith("Attention") and name != mixer} == {"attention_layer"}
    assert {part for name, part in parts.items() if name.endswith(("MLP", "MoE", "SparseMoeBlock"))} == {"mlp"}
    layer, norm, _ = LAYER_NORMS
    layers = [m for m in model.modules() if type(m).__name__.endswith(layer)]
    assert layers and all(sum(type(c).__name__.endswith(norm) for c in m.children()) == norms for m in layers)


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


def test_model_flops_and_mfu_rows():
    """model_flops counts 6 x matmul parameters per token (decoder Linears + head; routed experts at top_k /
    num_experts; no embeddings) and 12 H D per pair per attention layer; plan_memory_probe's rows get MFU, HFU,
    tokens/s, the FLOP ratio and its fraction reached (given seconds: nothing here depends on a timing)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from model_flops import PEAK_BF16_FLOPS, flop_rates, throughput
    from plan_memory_probe import add_throughput

    from harts_hf.trees import PrefixForest
    from tests.models import build

    model = build("llama")  # 2 layers, hidden 32, 4 heads of 16, MLP 48, vocab 97, untied head
    config = model.config
    per_layer = 32 * 16 * (4 + 2 + 2) + 4 * 16 * 32 + 3 * 32 * 48
    rates = flop_rates(model, checkpointed=[0, 1])
    assert rates["recompute_per_token"] == 2 * 2 * per_layer and rates["recompute_per_pair"] == 4 * 4 * 16 * 2
    assert flop_rates(model)["recompute_per_token"] == 0  # checkpointing is off
    assert flop_rates(model, checkpointed=[0, 1], attention_recomputed=False)["recompute_per_pair"] == 0
    one = flop_rates(model, checkpointed=[1])  # the other layer stored (tree_stored_layers=1)
    assert one["recompute_per_token"] == 2 * per_layer and one["recompute_per_pair"] == 4 * 4 * 16
    assert rates["layer_parameters"] == 2 * per_layer and rates["matmul_parameters"] == 2 * per_layer + 97 * 32
    assert rates["per_token"] == 6 * (2 * per_layer + 97 * 32) and rates["attention_layers"] == 2
    assert rates["per_pair"] == 12 * config.num_attention_heads * 16 * 2
    moe = flop_rates(build("qwen3_moe"))
    assert moe["layer_parameters"] < sum(p.numel() for n, p in build("qwen3_moe").named_parameters()
                                         if p.dim() > 1 and "embed" not in n and "lm_head" not in n)
    sequences = [[1, 2, 3, 4, 5], [1, 2, 3, 6], [1, 2, 7]]
    stats = PrefixForest.from_sequences(sequences).pack().stats()
    row = throughput(rates, 2.0, stats["unique_tokens"], stats["tree_attention_pairs"], stats["path_tokens"],
                     stats["path_attention_pairs"], recompute=True)
    assert row["mfu"] == row["model_flops"] / (2.0 * PEAK_BF16_FLOPS) and row["hfu"] > row["mfu"]
    assert row["flop_ratio"] > 1 and row["unique_tokens_per_s"] == stats["unique_tokens"] / 2.0
    rows = [dict(pieces=1, budget=None, seconds=1.0, peak_gib=1.0),
            dict(packed_groups=dict(seconds=3.0, peak_gib=1.0))]
    add_throughput(rows, model, sequences)
    assert rows[0]["speedup_vs_packed"] == 3.0
    assert rows[0]["fraction_of_flop_ratio"] == 3.0 / rows[0]["throughput"]["flop_ratio"]
    assert rows[1]["packed_groups"]["throughput"]["flop_ratio"] == 1.0


def test_one_entry_point_runs_every_script(tmp_path):
    """``python -m benchmarks``: every script with a main is a command (helpers are not), a CPU command runs through
    it, and the run record names the command, date, machine and versions."""
    import importlib

    bench = ROOT / "benchmarks"
    sys.path.insert(0, str(bench))
    from run_record import write_run_record

    from benchmarks.__main__ import COMMANDS

    scripts = {p.stem for p in bench.glob("*.py") if "def main(" in p.read_text()} - {"__main__"}
    assert {module for module, _ in COMMANDS.values()} == scripts
    for script in scripts:  # whatever writes results writes the run record (command, date, machine) with them
        source = (bench / f"{script}.py").read_text()
        assert '"--out"' not in source or "run_record" in source, f"{script}.py writes results without a run record"
    for module, _ in COMMANDS.values():
        assert callable(importlib.import_module(module).main)
    listing = subprocess.run([sys.executable, "-m", "benchmarks"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout
    assert all(name in listing for name in COMMANDS)
    run = subprocess.run([sys.executable, "-m", "benchmarks", "workloads", "--scales", "0.01", "--seeds", "0",
                          "--presets", "grpo"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert "grpo" in run.stdout and "R_tok" in run.stdout
    record = json.loads(write_run_record(tmp_path).read_text())
    assert {"command", "date", "host", "device", "versions"} <= record.keys() and record["versions"]["torch"]


def test_planner_benchmark_writes_its_rows(tmp_path):
    """``python -m benchmarks planner --out DIR``: every (batch, replicas, method) row in DIR/planner.json beside the
    run record; the planner duplicates no token and its max/mean is a finite ratio >= 1."""
    subprocess.run([sys.executable, "-m", "benchmarks", "planner", "--scale", "0.02", "--replicas", "2",
                    "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, check=True)
    rows = json.loads((tmp_path / "planner.json").read_text())["rows"]
    assert {(r["batch"], r["method"]) for r in rows} == {(b, m) for b in ("swe", "tau", "grpo")
                                                         for m in ("planner", "lpt", "dfs_cuts")}
    for row in rows:
        assert row["replicas"] == 2 and is_finite_nonnegative(row["plan_seconds"])
        assert math.isfinite(row["max_over_mean"]) and row["max_over_mean"] >= 1.0 - 1e-9
        assert row["method"] != "planner" or row["duplicated_tokens"] == 0
    assert json.loads((tmp_path / "run.json").read_text())["command"].startswith("python -m benchmarks planner")


def test_kimi_delta_attention_presets_and_latent_attention_flops():
    """The Ling-3-shaped and Kimi-Linear-shaped presets build (on the meta device) with their KDA:MLA ratios, and a
    latent-attention layer's per-pair FLOPs use its q/k and v head dims."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_tree_vs_trajectory import build_model
    from model_flops import flop_rates

    from tests.models import build

    for name, attention_layers in (("ling3_shaped", 2), ("kimi_linear_dense_shaped", 3)):
        with torch.device("meta"):
            model = build_model(name, "qwen3_next", torch.device("meta"), torch.bfloat16)
        assert model.config.layer_types.count("full_attention") == attention_layers
        assert flop_rates(model)["per_pair"] == 3 * 2 * 32 * (192 + 128) * attention_layers
    with torch.device("meta"):
        nemotron = build_model("nemotron_h_shaped", "qwen3_next", torch.device("meta"), torch.bfloat16)
    kinds = [type(layer.mixer).__name__ for layer in nemotron.model.layers]
    assert kinds.count("NemotronHAttention") == 2 and kinds.count("NemotronHMamba2Mixer") == 10
    assert flop_rates(nemotron)["per_pair"] == 3 * 2 * 16 * (128 + 128) * 2
    rates = flop_rates(build("deepseek_v3"))  # 4 heads, q/k 16 + 8, v 12, both layers attention
    assert rates["per_pair"] == 3 * 2 * 4 * (24 + 12) * 2


def test_every_kernel_set_puts_every_setting_in_force():
    """Each of the benchmarks' kernel sets names every setting (a set missing one would fail on the device, after
    its compilation), and ``fused`` puts harts_hf's defaults in force."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_tree_vs_trajectory import KERNEL_SETS, use_kernels

    from harts_hf.kernels.tree_attention import varlen
    from harts_hf.kernels.tree_gated_delta_rule import fla_backend
    from harts_hf.model_patches import gated_deltanet, mamba2

    for name, kernels in KERNEL_SETS.items():
        assert kernels.keys() == KERNEL_SETS["fused"].keys(), name
    saved = (fla_backend.STATE_PASS, varlen.GATHER_SUM, varlen.KERNEL, gated_deltanet.EXECUTED_LAYOUT,
             mamba2.CHUNK_SIZE)
    try:
        use_kernels("fused_rounds_state")
        assert fla_backend.STATE_PASS == "rounds"
        use_kernels("fused_executed_mixers")
        assert gated_deltanet.EXECUTED_LAYOUT
        from tests.models import build

        use_kernels("fused_keep_mixers_scan64", model=build("nemotron_h"))
        assert mamba2.CHUNK_SIZE == 64
        use_kernels("fused")  # harts_hf's defaults, but torch's flash varlen named (the default takes FlashAttention-4
        # where installed), as every row of that name ran
        assert varlen.KERNEL == "torch"
        assert (fla_backend.STATE_PASS, varlen.GATHER_SUM, gated_deltanet.EXECUTED_LAYOUT, mamba2.CHUNK_SIZE) == \
            saved[:2] + saved[3:]
    finally:
        use_kernels("fused")
        fla_backend.STATE_PASS, varlen.GATHER_SUM, varlen.KERNEL, gated_deltanet.EXECUTED_LAYOUT, \
            mamba2.CHUNK_SIZE = saved


def test_cost_model_refit_rebuilds_the_measured_forests(tmp_path):
    """`python -m benchmarks refit` on committed H200 results (CPU): the packed calls it rebuilds are the probe's
    (it raises otherwise), every forest gets the refit's, the held-out fit's and the defaults' errors, and the
    library's defaults are that refit's coefficients (to the digits written in harts_hf/planner/cost.py)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import refit_cost_model

    from harts_hf.planner import FEATURES, CostModel

    results = ROOT / "benchmarks" / "results" / "2026-12-01"
    workloads = {"tau": "plan_memory_probe_tau_fused_headline.json", "grpo": "plan_memory_probe_grpo_fused_headline.json",
                 "distinct": "plan_memory_probe_distinct.json"}
    refit, table = refit_cost_model.main([f"{w}={results / name}" for w, name in workloads.items()]
                                         + ["--out", str(tmp_path / "refit.json")])
    assert {row["name"] for row in table} >= {"tau tree", "tau packed call 10", "grpo tree", "distinct tree"}
    assert all(set(row["errors"]) == {"refit", "held_out", "default"} for row in table)
    for name in FEATURES:
        assert math.isclose(getattr(CostModel(), name), getattr(refit, name), rel_tol=5e-3, abs_tol=1e-12), name
    assert json.loads((tmp_path / "refit.json").read_text())["coefficients"].keys() == set(FEATURES)


def test_cost_model_refit_prices_with_a_saved_model(tmp_path):
    """``--model``: a saved cost model (fitted on earlier runs) prices every forest in a column of its own, the error
    of exactly that model's prediction; a model saved from this very refit reproduces the refit's column."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import refit_cost_model

    from harts_hf.planner import CostModel

    probe = ROOT / "benchmarks" / "results" / "2026-12-01" / "plan_memory_probe_distinct.json"
    refit, _ = refit_cost_model.main([f"distinct={probe}", "--save-model", str(tmp_path / "fit.json")])
    _, table = refit_cost_model.main([f"distinct={probe}", "--model", str(tmp_path / "fit.json")])
    assert all(math.isclose(row["errors"]["saved"], row["errors"]["refit"], abs_tol=1e-12) for row in table)
    saved = CostModel(unique_tokens=1e-4)
    saved.save(tmp_path / "other.json")
    _, table = refit_cost_model.main([f"distinct={probe}", "--model", str(tmp_path / "other.json")])
    for row in table:
        assert math.isclose(row["errors"]["saved"], saved.cost(row["features"]) / row["seconds"] - 1, rel_tol=1e-12)
    assert all("saved" not in row["errors"] for row in refit_cost_model.main([f"distinct={probe}"])[1])


def test_cost_model_refit_takes_the_pieces_of_a_replicas_run():
    """A ``--replicas`` record gives one sample per piece (its planner features, one call, its measured seconds),
    from the plan rebuilt with the record's ``pieces_per_replica`` (4 where the record predates the field); a plan
    that does not reproduce the record's pieces is refused, naming both."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from refit_cost_model import piece_samples

    from harts_hf.planner import plan
    from harts_hf.trees import PrefixForest

    prefix = list(range(1, 200))
    sequences = [prefix + [300 + i] * (120 + 7 * i) for i in range(6)]
    packed = PrefixForest.from_sequences(sequences).pack()
    for per_replica in (None, 4, 1):
        the_plan = plan(packed, num_replicas=2, token_budget=packed.num_tokens, pieces_per_replica=per_replica)
        record = dict(replicas=2, budget=None, pieces=len(the_plan.pieces),
                      piece_tokens=[p.unique_tokens for p in the_plan.pieces],
                      piece_seconds=[0.1 * (i + 1) for i in range(len(the_plan.pieces))])
        if per_replica != 4:
            record["pieces_per_replica"] = per_replica
        samples = piece_samples("tau", sequences, record)
        assert [s["seconds"] for s in samples] == record["piece_seconds"]
        assert [s["features"]["unique_tokens"] for s in samples] == record["piece_tokens"]
        assert all(s["features"]["microbatches"] == 1 for s in samples)
        assert sum(s["features"]["unique_tokens"] for s in samples) == packed.num_tokens
    with pytest.raises(ValueError, match="the rebuilt 2-replica plan has pieces of"):
        piece_samples("tau", sequences, dict(record, piece_tokens=record["piece_tokens"][::-1] + [1],
                                             pieces=len(record["piece_tokens"]) + 1))


def test_cost_model_refit_prices_a_tree_run_in_pieces():
    """A tree the probe ran as planner pieces is priced as the planner plans it at that budget: the pieces' features
    summed (every unique token once, one microbatch per piece, their rounds added), and a probe row whose piece count
    the rebuilt plan does not reproduce is refused, naming both counts."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from refit_cost_model import forest_features, plan_features

    from harts_hf.planner import plan
    from harts_hf.trees import PrefixForest

    prefix = list(range(1, 200))
    sequences = [prefix + [300 + i] * (120 + 7 * i) for i in range(6)]
    packed = PrefixForest.from_sequences(sequences).pack()
    pieces = len(plan(packed, num_replicas=1, token_budget=400).pieces)
    assert pieces > 1
    features = plan_features(sequences, 400, pieces)
    whole = forest_features(sequences, separate=False)
    assert features["unique_tokens"] == whole["unique_tokens"] == packed.num_tokens
    assert features["microbatches"] == pieces and whole["microbatches"] == 1
    with pytest.raises(ValueError, match=f"has {pieces} pieces, the probe ran {pieces + 1}"):
        plan_features(sequences, 400, pieces + 1)


@pytest.mark.parametrize("family", ["bailing_hybrid", "kimi_linear", "nemotron_h"])
def test_gpu_parity_model_stage_on_cpu(family):
    """The bf16 parity stage the H200 runs on the KDA and Mamba-2 presets, here on a tiny model of the family in
    fp32 on the CPU: every path and the fp32 copy run, and (all in fp32) agree; the gate parameters are reported."""
    import random

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_parity import model_parity

    from tests.forests import random_tree_sequences
    from tests.models import VOCAB, build

    sequences = random_tree_sequences(random.Random(0), 6, vocab=VOCAB, max_tail=40)
    results = {}
    model_parity(results, 0.0, model=build(family), sequences=sequences)
    parity = results["model_parity"]
    for path in ("tree", "per_trajectory", "packed_per_trajectory"):
        assert parity["logprob_absdiff_vs_fp32"][path]["max"] < 1e-4, (path, parity["logprob_absdiff_vs_fp32"])
        assert parity["grad_one_minus_cosine_vs_fp32"][path]["max"] < 1e-6
    gates = parity["gate_parameters_vs_fp32"]["tree"]
    assert "A_log" in gates and all(entry["max_rel"] < 1e-3 for entry in gates.values()), gates
    assert "timing" not in results  # timed on CUDA only


def test_gpu_attention_features_stage_on_cpu():
    """The attention-feature stage the H200 runs for issue 24's kernels, on the CPU in fp32 with small heads: the
    tree and the per-trajectory path agree with the per-run reference (window, v narrower than q/k, softcap, sinks),
    outputs and every input gradient (the sinks' too) with the trajectories' copies summed."""
    import random

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_kernels import ATTENTION_FEATURES, attention_features

    from tests.forests import random_tree_sequences

    sequences = random_tree_sequences(random.Random(1), 8, vocab=5, max_tail=30)
    small = {name: (4, 2, 8 + 4 * (d != dv), 8, dict(options, window=5) if "window" in options else options)
             for name, (_, _, d, dv, options) in ATTENTION_FEATURES.items()}
    row = {}
    attention_features(row, sequences, device="cpu", features=small)
    assert set(row["attention_features"]) == set(ATTENTION_FEATURES)
    for name, entry in row["attention_features"].items():
        for path in ("tree", "per_trajectory"):
            errors = entry[f"{path}_error_vs_fp32"]
            expected = {"out", "dq", "dk", "dv"} | ({"dsinks"} if "sinks" in name else set())
            assert set(errors) == expected and max(errors.values()) < 1e-5, (name, path, errors)
            assert is_finite_nonnegative(entry[f"{path}_s"])  # timed (fwd+bwd repeated), its size unchecked


def test_sft_benchmark_trains_the_same_rows_with_every_trainer(tmp_path):
    """`python -m benchmarks sft` on the CPU: TreeSFTTrainer (a step's rows as one forest), the packed per-row path
    (TreeSFTTrainer with every row its own tree, a step's rows in one micro-batch: `--packed-batch 0`) and TRL's
    SFTTrainer (micro-batches of 4 padded to a multiple of 64, gradient accumulation) train the same agent-trace rows to the same per-step loss; token
    counts are exact, times only present."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from sft_step import main

    common = ["--preset", "tiny", "--workload", "tau", "--scale", "0.005", "--steps", "2", "--batch", "4"]
    both = main(common + ["--trainer", "tree", "packed", "--packed-batch", "0", "--out", str(tmp_path / "both")])
    tree, packed = both["tree"], both["packed"]
    trl = main(common + ["--trainer", "trl", "--pad-to-multiple-of", "64", "--out", str(tmp_path / "trl")])["trl"]
    assert json.loads((tmp_path / "both" / "tree" / "sft.json").read_text())["steps"] == json.loads(
        json.dumps(tree["steps"]))
    assert (tmp_path / "both" / "packed" / "run.json").exists() and (tmp_path / "trl" / "sft.json").exists()
    assert packed["batch"] == tree["batch"] == tree["steps"][0]["rows"] and trl["batch"] == 4  # one packed call
    for a, b, c in zip(tree["steps"], trl["steps"], packed["steps"], strict=True):
        assert a["rows"] == b["rows"] == c["rows"] and a["rows"] % 4 == 0
        assert a["path_tokens"] == b["path_tokens"] == c["path_tokens"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["loss"] == pytest.approx(c["loss"], rel=1e-5)
        assert c["tree"]["tree/R_tok"] == pytest.approx(1.0) and c["flop_ratio"] == 1.0
        assert a["R_tok"] > 2 and a["tree"]["tree/R_tok"] == pytest.approx(a["R_tok"])
        assert is_finite_nonnegative(a["seconds"]) and is_finite_nonnegative(b["seconds"])
        assert a["flop_ratio"] > 2 and b["flop_ratio"] == 1.0


def test_attention_kernels_checks_shared_keys_on_a_forest(monkeypatch):
    """``attention_kernels.py --forest``'s check on the CPU (fp64), the CUDA kernels stood in for by per-sequence
    attention (torch's varlen call) and the explicit-softmax primitive: every cost factor's split, its difference
    from the plain call (rounding only) and each path's error against the fp32 per-run path."""
    import torch.nn.attention.varlen as torch_varlen

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import attention_kernels

    from harts_hf.kernels.tree_attention import shared_keys, varlen
    from tests.test_kernels import _varlen_attn_by_sequence

    monkeypatch.setattr(torch_varlen, "varlen_attn", _varlen_attn_by_sequence)
    monkeypatch.setattr(varlen, "varlen_kernel", lambda device, choice=None: "torch")
    monkeypatch.setitem(shared_keys._PRIMITIVES, "flash", shared_keys._PRIMITIVES["math"])
    monkeypatch.setattr(attention_kernels, "HQ", 4)
    monkeypatch.setattr(attention_kernels, "HKV", 4)
    monkeypatch.setattr(attention_kernels, "D", 12)
    monkeypatch.setattr(attention_kernels, "bench", lambda step: step() is None or 0.0)  # one untimed call
    row = attention_kernels.check_forest("tau", 0.005, 8, factors=(0.5, 8.0))
    assert not varlen.SHARED_KEYS_IN_PLACE and shared_keys.COST_FACTOR == 2.0  # restored
    assert varlen.GATHER_SUM == "rows"
    assert all(error["max"] == 0 for error in row["plain_index_add"]["vs_plain"].values())  # the CPU sums alike
    assert row["shared_keys_0.5"]["rest_rows"] < row["gathered_rows"] and row["shared_keys_0.5"]["blocks"] >= 1
    for name in ("shared_keys_0.5", "shared_keys_8"):
        assert all(error["max"] < 1e-12 for error in row[name]["vs_plain"].values())
    for name in ("plain", "shared_keys_0.5"):
        assert all(error["max"] < 1e-5 for error in row[name]["vs_fp32"].values())
