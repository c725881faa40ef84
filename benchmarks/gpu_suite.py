"""Everything the GPU issue measures, in ONE process (fla compiles and autotunes once per shape and process).

    python3 -u benchmarks/gpu_suite.py --out $OUT --budget 480 > $OUT/suite.log 2>&1   # on the H200

Write the log to a file under $OUT: when the device limit kills the command, piped output is lost with it.

Stages, in priority order, each saved as it finishes and skipped once ``--budget`` seconds are spent:
a warm-up on a tiny forest (fla compiles its kernels per head configuration and process), the cost fit
(c, a, b; or ``--fit`` from an earlier run), tree / packed / loop fwd+bwd per workload with the ~2B model
(bench_tree_vs_trajectory.py), bf16 parity against an fp32 reference on a 4-layer model with the same layer
shapes (gpu_parity.py), the kernel breakdown (gpu_kernels.py), then TRL's padded batches.
Set ``TRITON_CACHE_DIR`` / ``TILELANG_CACHE_DIR`` to a carried folder: compiled kernels and fla's autotuning
results are then reused by the next process (the first process spends ~150 s per path compiling).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import bench_tree_vs_trajectory as bench  # noqa: E402
import gpu_kernels as kernels  # noqa: E402
import gpu_parity as parity  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="results")
    parser.add_argument("--family", default="qwen3_next", choices=["qwen3_next", "qwen3_5"])
    parser.add_argument("--model", default="qwen3_next_2b", choices=list(bench.MODELS))
    parser.add_argument("--device", default="cuda", help="cuda; or cpu for a smoke run of the model stages "
                        "(--model tiny; the fla parity and kernel stages need CUDA and are skipped, and say so)")
    parser.add_argument("--workloads", nargs="+", default=["swe:0.05", "tau:0.05", "grpo:0.1"])
    parser.add_argument("--parity-scale", type=float, default=0.01)
    parser.add_argument("--budget", type=float, default=540.0, help="seconds; later stages are skipped past it")
    parser.add_argument("--fit", nargs=3, type=float, metavar=("C", "A", "B"),
                        help="reuse a cost fit (s/call, s/token, s/pair) from an earlier run instead of fitting")
    parser.add_argument("--compare-fused", action="store_true",
                        help="also time each workload's tree step with the fused per-round fla node (BATCH_ROUNDS off), with "
                             "fla's state pass per round and with the serial one (STATE_PASS; the default 'auto' "
                             "picks one per plan)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["parity", "kernels", "padded", "loop", "packed", "profile"])
    args = parser.parse_args()
    began = time.perf_counter()
    from run_record import write_run_record

    out = Path(args.out)
    write_run_record(out)
    device = torch.device(args.device)
    on_cuda = device.type == "cuda"

    def sync():
        if on_cuda:
            torch.cuda.synchronize()

    import transformers

    results = {"model": args.model, "family": args.family,
               "device": torch.cuda.get_device_name() if on_cuda else "cpu",
               "torch": torch.__version__, "transformers": transformers.__version__, "scale": "per workload",
               "workloads": {}, "stages": []}

    def save():
        (out / "gpu_suite.json").write_text(json.dumps(results, indent=2, default=str))

    model = bench.build_model(args.model, args.family, device, torch.bfloat16 if on_cuda else torch.float32)
    specs = [(spec.split(":")[0], float(spec.split(":")[1])) for spec in args.workloads]
    fit = {}

    def fit_costs(r):
        if args.fit:
            fit.update(c=args.fit[0], a=args.fit[1], b=args.fit[2])
            r["cost_fit"] = {"c_seconds_per_call": args.fit[0], "a_seconds_per_token": args.fit[1],
                             "b_seconds_per_pair": args.fit[2], "times": "given with --fit"}
            return
        lengths = [2048, 8192, 16384, 32768] if on_cuda else [64, 128, 256, 512]
        c, a, b, times = bench.fit_costs(model, device, lengths, model.config.vocab_size, 1)
        fit.update(c=c, a=a, b=b)
        r["cost_fit"] = {"c_seconds_per_call": c, "a_seconds_per_token": a, "b_seconds_per_pair": b, "times": times}

    def workload(r, name, scale):
        row = r["workloads"][f"{name}@{scale}"] = bench.bench_workload(
            model, device, name, scale, fit["c"], fit["a"], fit["b"], 1, 4, [*args.skip, "padded"])
        if args.compare_fused and not on_cuda:
            print("  --compare-fused: not run on cpu (the fla nodes need CUDA)", flush=True)
        if args.compare_fused and on_cuda:  # the same tree step with the fused per-round fla node, for the A/B
            from harts_hf.trees import PrefixForest

            forest = PrefixForest.from_sequences(bench.workload_sequences(name, scale, model.config.vocab_size))
            for key, label, switches in (("tree_fused_node", "the fused per-round node", dict(batched=False)),
                                         ("tree_rounds_state_pass", "fla's state pass per round",
                                          dict(state_pass="rounds")),
                                         ("tree_serial_state_pass", "the serial state pass",
                                          dict(state_pass="serial"))):
                seconds, peak = kernels.batched_rounds(
                    lambda: bench.timed(device, lambda: bench.run_tree(model, forest), 1), **switches)
                row[key] = {"seconds": seconds, "peak_gib": peak}
                print(f"  {name}@{scale}: tree with {label} {seconds:.3f} s, {peak:.1f} GiB", flush=True)

    def padded(r):
        for key, row in r["workloads"].items():
            name, scale = key.split("@")
            sequences = bench.workload_sequences(name, float(scale), model.config.vocab_size)
            seconds, peak = bench.timed(device, lambda s=sequences: bench.run_padded(model, s, device, 4), 1)
            row["padded"] = {"seconds": seconds, "peak_gib": peak}
            from harts_hf.trees import PrefixForest

            bench.add_throughput(row, model, PrefixForest.from_sequences(sequences).pack().stats())
            bench.score(row)
            print(f"  {key}: padded {seconds:.3f} s, {peak:.1f} GiB", flush=True)
            save()

    def profile(r):
        """torch.profiler over one warm tree step and one warm packed step of the first workload: device time per
        op (top 40) in ``profile_<path>.txt`` and, in the JSON, device time grouped by op family, to show where
        the tree path's per-token time goes next to the same kernels without sharing."""
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        from harts_hf.trees import PrefixForest

        name, scale = specs[0]
        sequences = bench.workload_sequences(name, scale, model.config.vocab_size)
        forests = {"tree": PrefixForest.from_sequences(sequences),
                   "packed": PrefixForest.from_sequences(sequences, groups=list(range(len(sequences))))}
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
        sort = "self_cuda_time_total" if on_cuda else "self_cpu_time_total"
        report = {}
        for path, forest in forests.items():
            bench.run_tree(model, forest)  # warm
            with torch_profile(activities=activities) as prof:
                bench.run_tree(model, forest)
                if on_cuda:
                    torch.cuda.synchronize()
            events = prof.key_averages()
            (out / f"profile_{path}.txt").write_text(events.table(sort_by=sort, row_limit=40))
            report[path], _ = op_families(events, on_cuda)
            print(f"  profile {path}: " + ", ".join(f"{k} {v:.3f}s" for k, v in list(report[path].items())[:6]),
                  flush=True)
        r["profile"] = {"workload": f"{name}@{scale}", "device_seconds_by_family" if on_cuda else
                        "cpu_seconds_by_family": report}

    def model_parity(r):
        small = parity.spread_decays(bench.build_model("qwen3_next_2b_4layers", args.family, device, torch.bfloat16))
        parity.model_parity(r, args.parity_scale, save, model=small, timing=False)

    def warmup(r):
        """Compile fla at these shapes on a tiny forest first: the tree path (varlen kernels) and one plain
        trajectory (transformers' kernels), timing each first and second call."""
        from harts_hf.trees import PrefixForest

        sequences = [list(range(1, 200)), list(range(1, 120)) + [7] * 90, list(range(1, 60)) + [9] * 40]
        forest = PrefixForest.from_sequences(sequences)
        times = {}
        for name, run in (("tree", lambda: bench.run_tree(model, forest)),
                          ("loop", lambda: bench.run_loop(model, sequences[:1], device))):
            for attempt in ("first", "second"):
                start = time.perf_counter()
                if attempt == "first":  # where the first call's seconds go (compilation, autotuning, host work)
                    profiler = cProfile.Profile()
                    profiler.runcall(run)
                    sync()
                    text = io.StringIO()
                    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(35)
                    (out / f"warmup_{name}_profile.txt").write_text(text.getvalue())
                else:
                    run()
                sync()
                times[f"{name}_{attempt}_s"] = time.perf_counter() - start
                print(f"  warm-up {name} {attempt}: {times[f'{name}_{attempt}_s']:.1f} s", flush=True)
        # transformers' path (loop, padded) compiles fla's norm kernels once per class of ceil(rows / 65536) rows,
        # rows = tokens x value heads: run one trajectory per class the workloads' lengths fall in, untimed
        if not {"loop", "padded"} <= set(args.skip):
            heads = model.config.linear_num_value_heads
            lengths = {len(s) for name, scale in specs
                       for s in bench.workload_sequences(name, scale, model.config.vocab_size)}
            classes = {-(-length * heads // 65536): length for length in sorted(lengths)}
            start = time.perf_counter()
            for length in classes.values():
                bench.run_loop(model, [[1] * length], device)
            sync()
            times["loop_length_classes"] = len(classes)
            times["loop_length_classes_s"] = time.perf_counter() - start
            print(f"  warm-up loop: {len(classes)} length classes in {times['loop_length_classes_s']:.1f} s", flush=True)
        if "padded" not in args.skip:  # the same for TRL's padded batches: rows = batch x padded width x heads
            heads = model.config.linear_num_value_heads
            batches = {}
            for name, scale in specs:
                lengths = sorted(len(s) for s in bench.workload_sequences(name, scale, model.config.vocab_size))
                for start in range(0, len(lengths), 4):  # run_padded's micro-batches of 4 rows, sorted by length
                    rows, width = len(lengths[start:start + 4]), lengths[start:start + 4][-1]
                    batches.setdefault(-(-rows * width * heads // 65536), (rows, width))
            start = time.perf_counter()
            for rows, width in batches.values():
                bench.run_padded(model, [[1] * width] * rows, device, 4)
            sync()
            times["padded_shape_classes"] = len(batches)
            times["padded_shape_classes_s"] = time.perf_counter() - start
            print(f"  warm-up padded: {len(batches)} classes in {times['padded_shape_classes_s']:.1f} s", flush=True)
        r["warmup"] = times

    stages = [("warmup", warmup), ("cost_fit", fit_costs)]
    stages += [(name, lambda r, s=(name, scale): workload(r, *s)) for name, scale in specs]
    if "profile" not in args.skip:
        stages.append(("profile", profile))
    if not on_cuda:
        for name in ("parity", "kernels"):
            if name not in args.skip:
                print(f"{name}: not run on {device} (fla's kernels need CUDA)", flush=True)
                results["stages"].append(f"{name}: not run on {device}")
    if "parity" not in args.skip and on_cuda:
        stages.append(("parity", model_parity))
    if "kernels" not in args.skip and on_cuda:
        stages.append(("kernel_parity", kernels.parity))
        stages.append(("handoff_parity", kernels.handoff_parity))
        stages.append(("final_state_parity", kernels.final_state_parity))
        stages += [(f"kernels_{name}", lambda r, s=(name, scale): kernels.timing(r, *s)) for name, scale in specs]
    if "padded" not in args.skip:  # TRL's padded batches last: every new batch shape costs transformers' path time
        stages.append(("padded", padded))
    for name, stage in stages:
        if time.perf_counter() - began > args.budget:
            results["stages"].append(f"{name}: skipped (budget)")
            save()
            continue
        start = time.perf_counter()
        try:
            stage(results)
            results["stages"].append(f"{name}: {time.perf_counter() - start:.0f} s")
        except Exception:  # keep going: report what broke and where
            results[f"{name}_error"] = traceback.format_exc()
            results["stages"].append(f"{name}: failed")
            print(results[f"{name}_error"], flush=True)
        save()
        print(results["stages"][-1], flush=True)
        if on_cuda:
            torch.cuda.empty_cache()
    if "cost_fit" in results:
        bench.print_table(results)
    print(json.dumps({k: results[k] for k in ("model_parity", "parity") if k in results}, indent=1, default=str))


_FAMILIES = (("gemm", ("gemm", "matmul", "mm", "addmm", "linear", "cutlass", "sm90_xmma", "nvjet")),
             ("flash attention", ("flash", "fmha", "varlen", "attention")),
             ("gated delta rule (fla / tilelang)", ("chunk_", "delta", "fwd_h", "dhu", "wy", "kkt", "solve_tril",
                                                   "recompute_w_u", "cumsum", "tilelang", "kernel_h")),
             ("norms", ("norm", "rms")),
             ("softmax / log-prob", ("softmax", "logsumexp", "log_softmax", "nll", "gather")),
             ("index / copy", ("index", "copy", "cat", "scatter", "gather", "to_copy", "elementwise_kernel_with_index")),
             ("conv", ("conv",)))


def op_families(events, on_cuda: bool) -> tuple[dict, float]:
    """Seconds by op family, largest first, from ``prof.key_averages()``, and the seconds of CUPTI's "Command Buffer
    Full" entries (the host blocked on a full launch queue; not a kernel). On CUDA kernels only: an aten op's device
    time is its kernels' again. On CPU the ops' self time."""
    from module_breakdown import is_kernel

    families, queue_full = {}, 0.0
    for event in events:
        seconds = (event.self_device_time_total if on_cuda else event.self_cpu_time_total) / 1e6
        if on_cuda and not is_kernel(event):  # host ops, the GPU spans of record_function ranges, a full queue
            if event.device_type == torch.autograd.DeviceType.CUDA and event.key == "Command Buffer Full":
                queue_full += seconds
            continue
        family = _op_family(event.key)
        families[family] = families.get(family, 0.0) + seconds
    return dict(sorted(families.items(), key=lambda kv: -kv[1])), queue_full


def _op_family(name: str) -> str:
    """A coarse family for a profiler event name (kernel or aten op)."""
    lowered = name.lower()
    for family, needles in _FAMILIES:
        if any(needle in lowered for needle in needles):
            return family
    return "other"


if __name__ == "__main__":
    main()
