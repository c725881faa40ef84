"""Where a planner microbatch's GPU memory goes: one tree forward vs the same forest as pieces.

Runs :func:`harts_hf.planner.execute_plan` on one `swe` task (the rows the multi-GPU benchmark trains as one prompt
group) with the ~2B preset (fp32 weights, bf16 autocast, non-reentrant gradient checkpointing: the trainer's
setting), once as one piece and once per ``--budget``, and reports for each run the wall time, the peak allocated
memory above the weights, the per-piece/phase trace of ``PlanExecution.memory``, and, from the CUDA caching
allocator's recorded history, the blocks alive at the peak grouped by the Python line that allocated them (the
innermost frame inside harts_hf / transformers / fla, and the innermost frame of any file).

    python3 benchmarks/plan_memory_probe.py --scale 0.2 --budget 0 32768 16384 --out results/memory
    python3 benchmarks/plan_memory_probe.py --scale 1.0 --budget 65536 --no-history --loop-sample 12   # full size
    python3 benchmarks/plan_memory_probe.py --scale 1.0 --budget 65536 --no-history --loop-sample 12 --attention cudnn
    python3 benchmarks/plan_memory_probe.py --workload tau --scale 1.0 --budget 0 --no-history --loop-sample -1
    python3 benchmarks/plan_memory_probe.py --workload tau --scale 1.0 --budget 0 --no-history --profile
    python3 benchmarks/plan_memory_probe.py --workload tau --scale 1.0 --budget 0 --no-history --packed-groups 0
    python3 benchmarks/plan_memory_probe.py --workload tau grpo distinct --scale 1.0 --budget 0 --no-history \
        --kernels fused_fa4 --repeats 2 --packed-groups 0 --out results/headline   # the headline, one process
    python3 benchmarks/plan_memory_probe.py --workload swe --scale 1.0 --budget 131072 --no-history --no-tree \
        --kernels fused_fa4 --packed-groups 131072 --packed-warmup first   # a large packed path in its own process
    python3 benchmarks/plan_memory_probe.py ... --no-tree --packed-groups 131072 --packed-calls 0:12 --out A  # its
        # first 12 calls (then --packed-calls 12: --out B in another process), then on any machine:
    python3 benchmarks/plan_memory_probe.py --workload swe --scale 1.0 --packed-groups 131072 --join-packed A B \
        --join-tree TREE/probe.json --out JOINED   # the whole packed path, its MFU, the tree's speed-up against it
    python3 benchmarks/plan_memory_probe.py --workload tau --scale 1.0 --budget 0 --no-history --replicas 2 4 8
    python3 benchmarks/plan_memory_probe.py --workload distinct --scale 1.0 --budget 0 --no-history --kernels fused_fa4 \
        --packed-groups 0 --interleave --repeats 4   # tree and packed timed alternately
    python3 benchmarks/plan_memory_probe.py --workload distinct tau:0.02 --scale 1.0 ...   # a scale per workload

``--loop-sample`` also times trajectories alone through the same kernels (the per-trajectory baseline at lengths
where the unpatched model's full ``[T, vocab]`` logits do not fit), next to the cost fit's price;
``--packed-groups`` times the strongest per-trajectory path over all trajectories: packed (each its own tree, no
padding) into calls of at most as many path tokens as the tree has unique ones (the same memory envelope).
``--replicas`` measures the planner's placement on several data-parallel ranks one rank after another on this GPU
(each rank's compute, next to the cost model's prediction; communication and waits are not in it).

Needs CUDA (``--join-packed`` does not). Writes ``OUT/probe.json`` (and ``OUT/run.json``: command, date, machine,
versions; with several workloads ``OUT/<workload>/`` each) and prints the tables.
Also ``python -m benchmarks step ...``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import json
import pstats
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_tree_vs_trajectory import KERNEL_SETS, MODELS, build_model, use_kernels  # noqa: E402
from model_flops import forest_throughput  # noqa: E402
from multi_gpu_tree_grpo import SPECIAL, _prompt_and_completions, _split_by_task  # noqa: E402
from packed_path import alloc_retries, consecutive_groups, merge_passes, packed_groups, second_run, timed_run  # noqa: E402
from rank_balance import replica_balance  # noqa: E402
from run_record import write_run_record  # noqa: E402

from harts_hf.model_patches import (  # noqa: E402
    checkpointed_layers,
    keep_attention_outputs,
    keep_matmul_outputs,
    store_layer_activations,
)

OURS = ("harts_hf", "transformers", "/fla/")


WORKLOADS = ("swe", "tau", "grpo", "search", "distinct")


def workload_spec(text: str) -> tuple[str, float | None]:
    """``--workload`` items: ``name`` or ``name:scale``."""
    name, _, scale = text.partition(":")
    if name not in WORKLOADS:
        raise argparse.ArgumentTypeError(f"unknown workload {name!r}; pick one of {', '.join(WORKLOADS)}")
    if not scale:
        return name, None
    try:
        value = float(scale)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"workload {text!r}: the scale after ':' must be a positive number, as in "
                                         f"{name}:0.02")
    return name, value


def task_sequences(scale: float, vocab: int, seed: int = 0, workload: str = "swe") -> list[list[int]]:
    """One ``swe`` task (the rows the multi-GPU benchmark trains as one prompt group), or another preset's whole
    generation batch."""
    from harts_hf.workloads import make_workload

    if workload != "swe":
        return [list(s) for s in make_workload(workload, scale=scale, seed=seed, vocab_size=vocab).sequences]
    workload = make_workload("swe", scale=scale, seed=seed, num_tasks=1, vocab_size=vocab - len(SPECIAL))
    prompt, completions, _ = _prompt_and_completions(_split_by_task(workload)[0])
    return [prompt + completion for completion in completions]


TRACE_KEYS = ("trace_peak_gib", "peak_by_our_line", "peak_by_line")  # what a run with the allocator's history adds


def live_at_peak(snapshot: dict, device: int) -> tuple[float, list, list]:
    """Replay the allocator trace: the largest live total (GiB, relative to the recording's start) and the blocks
    alive then, summed by allocating line (ours, any)."""
    events = snapshot["device_traces"][device]
    live, total, peak, peak_index = {}, 0, 0, -1
    for i, event in enumerate(events):
        if event["action"] == "alloc":
            live[event["addr"]] = event["size"]
            total += event["size"]
            if total > peak:
                peak, peak_index = total, i
        elif event["action"] == "free_requested" and event["addr"] in live:
            total -= live.pop(event["addr"])
    alive = {}
    for event in events[:peak_index + 1]:
        if event["action"] == "alloc":
            alive[event["addr"]] = event
        elif event["action"] == "free_requested":
            alive.pop(event["addr"], None)
    ours, anywhere = Counter(), Counter()
    for event in alive.values():
        frames = event.get("frames") or []
        where = [f"{f['filename'].split('site-packages/')[-1]}:{f['line']} {f['name']}" for f in frames]
        mine = next((w for w, f in zip(where, frames) if any(k in f["filename"] for k in OURS)), "?")
        ours[mine] += event["size"]
        anywhere[where[0] if where else "?"] += event["size"]
    top = lambda counter: [(k, round(v / 2**30, 3)) for k, v in counter.most_common(25)]  # noqa: E731
    return peak / 2**30, top(ours), top(anywhere)


def run(model, sequences, budget, device, history: bool, attention: str = "auto", recompute: bool = True) -> dict:
    from harts_hf.model_patches import chunk_grid
    from harts_hf.planner import execute_plan, plan
    from harts_hf.trees import PrefixForest

    packed = PrefixForest.from_sequences(sequences).pack()
    the_plan = plan(packed, num_replicas=1, token_budget=budget or packed.num_tokens, chunk_size=chunk_grid(model))
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(len(s) - 1, generator=generator) * 1e-4 for s in sequences]
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    retries = alloc_retries(device)
    if history:
        torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                                 max_entries=2_000_000)
    start = time.perf_counter()
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            execution = execute_plan(model, the_plan, logprob_weights=weights,  # bf16 head, as the trainer's default
                                     attention_backend=attention, recompute=recompute)
        torch.cuda.synchronize(device)
    except BaseException:
        if history:  # an out-of-memory error (caught by the caller) must not leave every later run recording
            torch.cuda.memory._record_memory_history(enabled=None)
        raise
    seconds = time.perf_counter() - start
    row = dict(budget=budget, unique_tokens=packed.num_tokens, pieces=len(the_plan.pieces), seconds=seconds,
               base_gib=base / 2**30, peak_gib=torch.cuda.max_memory_allocated(device) / 2**30,
               reserved_gib=torch.cuda.max_memory_reserved(device) / 2**30,
               alloc_retries=alloc_retries(device) - retries,  # cache flushes (cudaFree + retry) in the run
               stats=execution.stats,
               memory=[(p, phase, round(a, 3), round(m, 3)) for p, phase, a, m in execution.memory],
               piece_tokens=[p.unique_tokens for p in the_plan.pieces])  # (the plan's segments: long runs cut)
    if history:
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        row.update(zip(TRACE_KEYS, live_at_peak(snapshot, device.index or 0)))
    model.zero_grad(set_to_none=True)
    return row  # the allocator's cache stays warm, as between a trainer's steps (an emptied cache puts cudaMalloc
    # calls into the next timed run, which the per-trajectory sample's runs do not pay)


def profile(model, sequences, device, attention: str, out: Path, loop_count: int = 8,
            parts=("tree", "loop", "packed"), budget: int | None = None) -> dict:
    """Warm runs under torch.profiler: the whole forest (in pieces of at most ``budget`` unique tokens where given),
    ``loop_count`` of its trajectories alone (length quantiles 0.1-0.9, the per-trajectory path) and ONE packed call of
    its first trajectories up to the forest's unique-token count or ``budget``, the smaller (the packed per-trajectory
    path at the tree's size: a piece's where the forest runs in pieces). For each: kernel seconds by op family
    (gpu_suite's families) and by model part, forward / recomputed forward / backward (:mod:`module_breakdown`: GDN
    layers with the tree conv and the gated delta rule inside, attention layers with the attention kernel inside, MLPs,
    the decoder layers' norms, the LM head, the rest), their sum, the wall time (the gap is host time the GPU waited
    for) and the tokens it ran (unique for the tree, path tokens for the others), so they compare per token; the top
    kernels go to ``profile_<name>.txt`` (the tree's also by input shape and Python stack to
    ``profile_tree_by_source.txt``), and a cProfile of one more warm tree run (host time by Python function) to
    ``profile_tree_host.txt`` (by cumulative time) and ``profile_tree_host_self.txt`` (by own time)."""
    from gpu_suite import op_families
    from module_breakdown import attribute, labelled, table
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from harts_hf.trees import PrefixForest

    picks = _quantile_picks(sequences, loop_count)
    unique = PrefixForest.from_sequences(sequences).pack().num_tokens
    group = consecutive_groups(sequences, min(unique, budget or unique))[0]
    packed = PrefixForest.from_sequences(group, groups=list(range(len(group))))
    forests = {"tree": [sequences], "loop": [[sequences[i]] for i in picks], "packed": [group]}
    forests = {name: batch for name, batch in forests.items() if name in parts}
    report = {}
    out.mkdir(parents=True, exist_ok=True)
    for name, batch in forests.items():
        if name == "packed":
            second_run(model, packed, device, attention)  # compiles / autotunes its lengths
        for forest in batch if name == "loop" else []:  # the tree is warm from the timed runs
            run(model, forest, None, device, history=False, attention=attention)
        sources = name == "tree"  # input shapes and Python stacks: which line each copy / gather comes from
        with labelled(model), torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                                            record_shapes=sources, with_stack=sources) as prof:
            if name == "packed":
                runs = [dict(seconds=timed_run(model, packed, device, attention), unique_tokens=sum(map(len, group)))]
            else:
                runs = [run(model, forest, budget if name == "tree" else None, device, history=False,
                            attention=attention) for forest in batch]
        wall, tokens = sum(r["seconds"] for r in runs), sum(r["unique_tokens"] for r in runs)
        events = prof.key_averages()
        (out / f"profile_{name}.txt").write_text(events.table(sort_by="self_cuda_time_total", row_limit=50))
        if sources:
            (out / f"profile_{name}_by_source.txt").write_text(device_time_by_source(prof.events()))
        families, queue_full = op_families(events, on_cuda=True)
        by_part = attribute(prof.events(), on_cuda=True)  # not `parts`: the names asked for are checked below
        report[name] = dict(wall_seconds=wall, device_seconds=sum(families.values()), tokens=tokens,
                            device_seconds_by_family=families, launch_queue_full_seconds=queue_full,
                            device_seconds_by_part=by_part)
        print(f"profile {name} ({len(batch)} forest(s) of {sum(map(len, batch))} trajectories, {tokens} tokens): "
              f"wall {wall:.2f} s, device {report[name]['device_seconds']:.2f} s: "
              + ", ".join(f"{k} {v:.2f}" for k, v in families.items()), flush=True)
        print(f"  by part (device s; all {by_part['total']:.2f}):\n" + table(by_part, tokens), flush=True)
    if "tree" not in parts:
        return report
    profiler = cProfile.Profile()  # host time of one warm tree run: where a small forest's fixed cost goes
    report["tree"]["host_wall_seconds"] = profiler.runcall(
        lambda: run(model, sequences, budget, device, history=False, attention=attention)["seconds"])
    for order, name in (("cumulative", "profile_tree_host.txt"), ("tottime", "profile_tree_host_self.txt")):
        text = io.StringIO()  # by time inside and below each function, then by its own time
        pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(60)
        (out / name).write_text(text.getvalue())
    return report


def device_time_by_source(events, depth: int = 3, rows: int = 120) -> str:
    """A table of device time by dispatcher op, input shapes and where it was called: the nearest ``depth`` Python
    frames in harts_hf / transformers / fla, or for the backward (autograd's threads have no Python stack) the
    autograd node that ran it. Kernels count towards the innermost op that launched them."""
    totals = defaultdict(lambda: [0.0, 0])
    for event in events:
        if not event.name.startswith("aten::") or event.self_device_time_total <= 0:
            continue
        frames, parent, node = [], event.cpu_parent, None
        while parent is not None and len(frames) < depth:
            if ".py(" in parent.name and any(key in parent.name for key in OURS):
                frames.append(parent.name.split("site-packages/")[-1])
            elif node is None and not parent.name.startswith("aten::") and ".py(" not in parent.name:
                node = parent.name
            parent = parent.cpu_parent
        key = (event.name, str(event.input_shapes)[:80], " < ".join(frames) or str(node))
        totals[key][0] += event.self_device_time_total
        totals[key][1] += 1
    lines = ["device ms  calls  op  input shapes  called from"]
    for (op, shapes, where), (micros, calls) in sorted(totals.items(), key=lambda item: -item[1][0])[:rows]:
        lines.append(f"{micros / 1e3:9.2f} {calls:6d}  {op}  {shapes}  {where}")
    return "\n".join(lines) + "\n"


def _quantile_picks(sequences, count: int) -> list[int]:
    """Indices of ``count`` sequences at length quantiles 0.1-0.9 in index order (all of them, shortest first, for
    ``count < 0``)."""
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    if count < 0 or count >= len(order):
        return order
    return sorted({order[int(q * (len(order) - 1))] for q in [0.1 + 0.8 * i / max(count - 1, 1)
                                                                for i in range(count)]})


def warm_up(model, sequences, args, device) -> dict:
    """One untimed tree run at the largest piece size asked for (``--budget`` 0: the forest in one piece) that fits:
    a size that runs out of memory passes the warm-up to the next (its timed runs record it as out of memory)."""
    budgets = sorted(args.budget, key=lambda b: -(b or float("inf")))
    for i, budget in enumerate(budgets):
        try:
            return run(model, sequences, budget or None, device, history=False, attention=args.attention,
                       recompute=not args.no_recompute)
        except torch.OutOfMemoryError:
            if i == len(budgets) - 1:
                raise
            model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            print(f"warm-up: budget {budget} out of memory; the next", flush=True)


def loop_sample(model, sequences, count: int, device, fit, attention: str = "auto") -> dict:
    """The per-trajectory path on ``count`` trajectories (all for -1): each alone, fwd+bwd, with its fitted price;
    with all of them, ``measured_seconds`` is the whole per-trajectory loop."""
    from harts_hf.trees import PrefixForest

    c, a, b = fit

    def price(length: int) -> float:
        return c + a * length + b * length ** 2 / 2

    picks = _quantile_picks(sequences, count)
    rows = []
    for i in picks:
        try:
            seconds = second_run(model, PrefixForest.from_sequences([sequences[i]]), device, attention)
        except torch.OutOfMemoryError:
            seconds = float("nan")
        length = len(sequences[i])
        rows.append(dict(length=length, seconds=seconds, fit_seconds=price(length)))
        print(f"per-trajectory: {length} tokens {seconds:.3f} s (fit {rows[-1]['fit_seconds']:.3f} s)", flush=True)
        model.zero_grad(set_to_none=True)
    measured, priced = sum(r["seconds"] for r in rows), sum(r["fit_seconds"] for r in rows)
    total_priced = sum(price(len(s)) for s in sequences)
    print(f"per-trajectory: {len(rows)} of {len(sequences)} trajectories measured {measured:.2f} s, priced "
          f"{priced:.2f} s; the whole loop priced {total_priced:.2f} s", flush=True)
    return dict(trajectories=rows, measured_seconds=measured, priced_seconds=priced, all=len(rows) == len(sequences),
                whole_loop_priced_seconds=total_priced)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", type=float, default=0.2)
    parser.add_argument("--workload", nargs="+", default=[("swe", None)], type=workload_spec, metavar="NAME[:SCALE]",
                        help=f"one of {', '.join(WORKLOADS)} (swe: one task; the others: the preset's whole batch), "
                             "optionally with its own scale (tau:0.02; default --scale); several: one after the "
                             "other in this process (kernels compile once), each written to OUT/<name> (OUT/<name>_"
                             "<scale> with a scale of its own)")
    parser.add_argument("--budget", type=int, nargs="+", default=[0, 32768],
                        help="token budgets to run, 0 = the whole forest as one piece (default: %(default)s)")
    parser.add_argument("--model", default="qwen3_next_2b", choices=sorted(MODELS))
    parser.add_argument("--loop-only", action="store_true", help="only the per-trajectory sample (--loop-sample)")
    parser.add_argument("--no-tree", action="store_true",
                        help="no tree runs: the packed path (--packed-groups), profile and loop sample alone, with the "
                             "first kernel set and settings in force (a large workload's packed path in a process of "
                             "its own, under a device call's time limit)")
    parser.add_argument("--no-history", action="store_true", help="skip the allocator history (faster)")
    parser.add_argument("--no-recompute", action="store_true",
                        help="execute_plan(recompute=False): a hand-off source runs one forward with gradient and "
                             "keeps its graph while its children run (no no-grad forward first; more memory)")
    parser.add_argument("--loop-sample", type=int, default=0,
                        help="also time this many of the task's trajectories alone (-1: all), each its own forward "
                             "and backward through the same kernels (the tree path on a one-sequence forest: fla, "
                             "flash varlen, chunked LM head, so long trajectories fit), second of two runs each, at "
                             "length quantiles 0.1..0.9, next to the cost fit's price of each (--fit)")
    parser.add_argument("--fit", nargs=3, type=float, default=[0.1595, 4.6416e-05, 1.5976e-09], metavar=("C", "A", "B"))
    parser.add_argument("--attention", default="auto", choices=["auto", "varlen", "cudnn"],
                        help="tree attention kernel for the tree and the per-trajectory sample alike")
    parser.add_argument("--profile", nargs="*", choices=["tree", "loop", "packed"], default=None,
                        help="also run the whole forest once more (in pieces of the first --budget), 8 (or "
                             "--loop-sample) of its trajectories alone and one packed call of its first trajectories "
                             "up to its unique-token count (or that budget, the smaller), under "
                             "torch.profiler: kernel seconds per op family and per model part (forward / recomputed "
                             "forward / backward of GDN layers, tree conv, gated delta rule, attention, MLP, norms, "
                             "head) and tokens of each, the top kernels in OUT/profile_<tree|loop|packed>.txt; "
                             "followed by names, only those runs")
    parser.add_argument("--packed-groups", type=int, default=None, metavar="TOKENS",
                        help="also time the packed per-trajectory path over ALL trajectories, in calls of at most "
                             "TOKENS path tokens (0: the forest's unique-token count, i.e. the tree's memory envelope)")
    parser.add_argument("--packed-calls", type=call_range, default=None, metavar="START:STOP",
                        help="time only the packed calls START..STOP-1 (0-based; the calls as --packed-groups cuts "
                             "them), e.g. a path too long for one device call split over two processes; the JSON "
                             "then holds those calls only, each with its index")
    parser.add_argument("--packed-warmup", choices=["each", "first"], default="each",
                        help="an untimed run before each packed call's timed ones (each; the default) or before the "
                             "first call only (one pass fewer; where no call size compiles anything new)")
    parser.add_argument("--kernels", nargs="+", default=["fused"], choices=sorted(KERNEL_SETS),
                        help="kernel sets to time the tree with, each after its own warm-up: fused (harts_hf's RMSNorm, "
                             "fla's gated RMSNorm / SwiGLU, harts_hf's log-prob kernels, torch's flash varlen; the default), "
                             "reference (transformers' PyTorch code, the chunked fp32 log-softmax) or fused_fa4 "
                             "(fused, attention on FlashAttention-4); the packed, profile and loop runs use the first")
    parser.add_argument("--repeats", type=int, default=2,
                        help="timed runs of the tree per budget and kernel set (seconds: their mean; all kept)")
    parser.add_argument("--stored-layers", type=int, nargs="+", default=[0],
                        help="decoder layers left out of gradient checkpointing (harts_hf's tree_stored_layers), one "
                             "tree run per count; a count that does not fit is recorded as out of memory. The "
                             "packed, profile and loop runs use the first")
    parser.add_argument("--matmul-layers", type=int, nargs="+", default=[0],
                        help="checkpointed decoder layers that also keep their matrix products' outputs "
                             "(keep_matmul_outputs: the backward's rerun skips their GEMMs), one tree run per count; "
                             "the packed, profile and loop runs use the first")
    parser.add_argument("--keep-attention", nargs="+", default=["on"], choices=["on", "off"],
                        help="keep attention outputs under checkpointing (tree_keep_attention_outputs, the trainer's "
                             "default) or rerun the attention; one tree run per setting (and stored-layer count); "
                             "the packed, profile and loop runs use the first")
    parser.add_argument("--interleave", action="store_true",
                        help="time the tree and the packed path alternately (tree run, packed pass, tree run, ...; "
                             "--repeats of each after one warm-up each), so that drift over the process (clocks, "
                             "temperature, the allocator's state) falls on both alike; one kernel set, budget and "
                             "setting; needs --packed-groups")
    parser.add_argument("--replicas", type=int, nargs="+", default=[],
                        help="also measure the planner's placement on this many data-parallel ranks, one rank after "
                             "another on this GPU (each rank's compute; no communication): predicted and measured "
                             "seconds per rank and their max/mean, at the first budget")
    parser.add_argument("--join-packed", nargs="+", default=None, metavar="DIR",
                        help="no runs (CPU): join the packed calls that --packed-calls runs of this command wrote "
                             "(each DIR's probe_packed_calls.json) into the whole packed path, with its MFU and, "
                             "given --join-tree, the tree's speed-up and fraction against it; written to OUT")
    parser.add_argument("--join-tree", default=None, metavar="PROBE_JSON",
                        help="with --join-packed: a tree run's probe.json (its tree rows) on the same workload")
    parser.add_argument("--out", default="results/memory")
    args = parser.parse_args(argv)
    if args.join_tree and not args.join_packed:
        parser.error("--join-tree goes with --join-packed")
    if args.join_packed:
        if args.packed_groups is None or len(args.workload) != 1:
            parser.error("--join-packed needs the parts' --packed-groups and their one --workload")
        return join_packed(args)
    if args.interleave:
        several = [name for name, values in (("--kernels", args.kernels), ("--budget", args.budget),
                                               ("--keep-attention", args.keep_attention),
                                               ("--stored-layers", args.stored_layers),
                                               ("--matmul-layers", args.matmul_layers)) if len(values) > 1]
        if several or args.packed_groups is None or args.no_tree or args.loop_only:
            parser.error(f"--interleave alternates one tree setting with the packed path: give one value to "
                         f"{', '.join(several) or 'each setting'}, pass --packed-groups, and leave out --no-tree / "
                         f"--loop-only")
    if not torch.cuda.is_available():
        raise SystemExit("plan_memory_probe needs CUDA (the allocator trace is CUDA's)")
    device = torch.device("cuda", 0)
    model = build_model(args.model, "qwen3_next", device, torch.float32)
    if any(type(m).__name__.endswith("Experts") for m in model.modules()):  # routed experts: transformers' kernels
        print(f"experts implementation: {model.config._experts_implementation}", flush=True)  # grouped_mm or eager
    for workload, scale in args.workload:  # one process: kernels compile and autotune once for all of them
        name = workload if scale is None else f"{workload}_{scale:g}"
        probe_workload(argparse.Namespace(**{**vars(args), "scale": args.scale if scale is None else scale}), model,
                       device, workload, Path(args.out) if len(args.workload) == 1 else Path(args.out) / name)


def join_packed(args) -> list[dict]:
    """``--join-packed``: the whole packed path from its parts, the tree rows of ``--join-tree`` beside it, MFU from
    the model's shapes (built on the meta device: no weights, no GPU); ``OUT/probe.json`` as a run of both writes."""
    from packed_path import join_parts

    workload, scale = args.workload[0]
    scale = args.scale if scale is None else scale
    sequences = task_sequences(scale, MODELS[args.model]["vocab_size"], workload=workload)
    parts = [json.loads((Path(directory) / "probe_packed_calls.json").read_text()) for directory in args.join_packed]
    packed = join_parts(parts, sequences, packed_cap(args, sequences))
    packed.update(keep_attention=args.keep_attention[0], joined_from=list(args.join_packed))
    rows = [] if args.join_tree is None else [r for r in json.loads(Path(args.join_tree).read_text())
                                              if r.get("pieces") is not None]
    for row in rows:
        if row.get("unique_tokens", packed["unique_tokens"]) != packed["unique_tokens"]:
            raise ValueError(f"--join-tree {args.join_tree}: its tree ran {row['unique_tokens']} unique tokens, this "
                             f"workload has {packed['unique_tokens']}: not the same workload or scale")
    rows.append(dict(packed_groups=packed))
    with torch.device("meta"):
        model = build_model(args.model, "qwen3_next", torch.device("meta"), torch.float32)
    print(f"packed per-trajectory, joined from {len(parts)} parts: {packed['calls']} calls, {packed['seconds']:.2f} s "
          f"(repeats {', '.join(f'{x:.2f}' for x in packed['repeat_seconds'])}), peak {packed['peak_gib']:.1f} GiB",
          flush=True)
    add_throughput(rows, model, sequences)
    out = Path(args.out)
    write_run_record(out)
    (out / "probe.json").write_text(json.dumps(rows, indent=1))
    return rows


def probe_workload(args, model, device, workload: str, out: Path) -> None:
    """Every run ``args`` asks for on one workload preset's batch, written to ``out``."""
    sequences = task_sequences(args.scale, MODELS[args.model]["vocab_size"], workload=workload)
    rows = []
    write_run_record(out)

    def save():  # after every stage: a run stopped by a time limit keeps what it measured
        (out / "probe.json").write_text(json.dumps(rows, indent=1))

    use_kernels(args.kernels[0], model)  # in force for the packed, profile and loop runs when no tree runs
    if args.interleave:
        rows.extend(interleaved(
            args, model, sequences, device,
            lambda calls: (out / "probe_packed_calls.json").write_text(json.dumps(calls, indent=1)),
            lambda so_far: (out / "probe_interleaved_partial.json").write_text(json.dumps(so_far, indent=1))))
        save()
        print_tree_row(rows[-2])
    first = (args.keep_attention[0], args.stored_layers[0], args.matmul_layers[0])  # each setting's first value
    for kernels in [] if args.loop_only or args.no_tree or args.interleave else reversed(args.kernels):
        use_kernels(kernels, model)
        checkpointing(model, *first)  # the warm-up (compilation, autotuning, cuDNN plans) runs as the first timed run
        try:
            warm = warm_up(model, sequences, args, device)
        except Exception as error:  # noqa: BLE001 - a kernel set that fails is recorded; the next one runs
            model.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            rows.append(dict(kernels=kernels, error=f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"))
            save()
            print(f"{kernels} kernels: failed in the warm-up: {rows[-1]['error']}", flush=True)
            continue
        print(f"{kernels} kernels: tree warm-up run {warm['seconds']:.2f} s", flush=True)
        for keep, stored, matmul in itertools.product(args.keep_attention, args.stored_layers, args.matmul_layers):
            matmul_layers = checkpointing(model, keep, stored, matmul)
            for budget in [b or None for b in args.budget]:
                try:  # the allocator's history slows a run: recorded in a run of its own, before the timed ones
                    traced = None if args.no_history or stored else run(
                        model, sequences, budget, device, history=True, attention=args.attention,
                        recompute=not args.no_recompute)
                    repeats = [run(model, sequences, budget, device, history=False, attention=args.attention,
                                   recompute=not args.no_recompute) for _ in range(max(args.repeats, 1))]
                except torch.OutOfMemoryError as error:
                    model.zero_grad(set_to_none=True)
                    torch.cuda.empty_cache()
                    rows.append(dict(kernels=kernels, budget=budget, stored_layers=stored, keep_attention=keep,
                                     matmul_layers=matmul, out_of_memory=str(error).split("\n")[0]))
                    save()
                    print(f"{kernels} kernels, budget {budget}, attention outputs kept {keep}, {stored} stored layers, "
                          f"{matmul} matmul layers: out of memory", flush=True)
                    continue
                rows.append(tree_row(model, repeats, kernels, keep, stored, matmul, matmul_layers))
                if traced is not None:
                    rows[-1].update({key: traced[key] for key in TRACE_KEYS})
                save()
                print_tree_row(rows[-1])
    checkpointing(model, *first)  # in force for the packed, profile and loop runs
    if args.profile is not None:
        rows.append(dict(profile=profile(model, sequences, device, args.attention, out,
                                         max(args.loop_sample, 8), args.profile or ("tree", "loop", "packed"),
                                         args.budget[0] or None)))
        save()
    for replicas in args.replicas:
        rows.append(dict(replica_balance=replica_balance(model, sequences, args.budget[0] or None, replicas, device,
                                                         args.attention)))
        save()
        r = rows[-1]["replica_balance"]
        print(f"{replicas} ranks: {r['pieces']} pieces, {r['cross_replica_handoffs']} cross-rank hand-offs, max/mean "
              f"predicted {r['predicted_imbalance']:.3f}, measured {r['measured_imbalance']:.3f}; per rank measured "
              f"{', '.join(f'{x:.2f}' for x in r['measured_seconds'])} s, predicted "
              f"{', '.join(f'{x:.2f}' for x in r['predicted_seconds'])} s", flush=True)
    if args.packed_groups is not None:
        if not args.interleave:
            rows.append(dict(packed_groups=packed_groups(
                model, sequences, packed_cap(args, sequences), device, args.attention,
                progress=lambda calls: (out / "probe_packed_calls.json").write_text(json.dumps(calls, indent=1)),
                repeats=max(args.repeats, 1), warmup=args.packed_warmup, calls=args.packed_calls)))
        packed = next(r["packed_groups"] for r in rows if "packed_groups" in r)
        packed["keep_attention"] = args.keep_attention[0]
        save()
        for tree in (r for r in rows if r.get("pieces") is not None):
            speedup = packed["seconds"] / tree["seconds"]
            print(f"tree, budget {tree['budget']}: {tree['seconds']:.2f} s, {speedup:.2f}x the packed path, "
                  f"{speedup / packed['S_phys_packed']:.3f} of S_phys {packed['S_phys_packed']:.2f}", flush=True)
    if args.loop_sample:
        rows.append(dict(loop_sample=loop_sample(model, sequences, args.loop_sample, device, args.fit,
                                                 args.attention)))
        save()
    add_throughput(rows, model, sequences)
    save()


def call_range(text: str) -> slice:
    """``START:STOP`` (either may be empty) as a slice of the packed calls."""
    start, sep, stop = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return slice(int(start) if start else None, int(stop) if stop else None)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--packed-calls {text!r}: expected START:STOP, e.g. 0:12 or 12:") from None


def packed_cap(args, sequences) -> int:
    """The packed path's call size: ``--packed-groups``, or 0 for the forest's unique-token count."""
    from harts_hf.trees import PrefixForest

    return args.packed_groups or PrefixForest.from_sequences(sequences).pack().num_tokens


def checkpointing(model, keep: str, stored: int, matmul: int) -> list[int]:
    """Put one combination of the checkpointing settings in force (``--keep-attention``, ``--stored-layers``,
    ``--matmul-layers``); returns the layers whose matrix products are kept."""
    keep_attention_outputs(model, keep == "on")
    store_layer_activations(model, stored)
    return keep_matmul_outputs(model, matmul)


def tree_row(model, runs: list[dict], kernels: str, keep: str, stored: int, matmul: int, matmul_layers) -> dict:
    """One tree setting's timed :func:`run` results as a row: the first run's fields, every run's seconds, their
    mean, the largest peak, and the checkpointing in force."""
    checkpointed = checkpointed_layers(model)
    return dict(runs[0], kernels=kernels, stored_layers=stored, keep_attention=keep, matmul_layers=matmul,
                checkpointed_layers=checkpointed,
                recomputing_matmuls=[i for i in checkpointed if i not in matmul_layers],
                seconds_all=[r["seconds"] for r in runs], seconds=float(np.mean([r["seconds"] for r in runs])),
                alloc_retries_all=[r["alloc_retries"] for r in runs],
                peak_gib=max(r["peak_gib"] for r in runs))


def print_tree_row(r: dict) -> None:
    print(f"{r['kernels']} kernels, budget {r['budget']}, attention outputs kept {r['keep_attention']}, "
          f"{r['stored_layers']} stored layers, {r['matmul_layers']} matmul layers: {r['pieces']} pieces, "
          f"{r['seconds']:.2f} s (runs {', '.join(f'{x:.2f}' for x in r['seconds_all'])}), peak "
          f"{r['peak_gib']:.1f} GiB (weights etc. {r['base_gib']:.1f}), reserved {r['reserved_gib']:.1f}, "
          f"{sum(r.get('alloc_retries_all', [0]))} allocator retries", flush=True)
    for p, phase, a, m in r["memory"]:
        print(f"   piece {p:3d} {phase:9s} allocated {a:7.2f} peak {m:7.2f}")
    for key in ("peak_by_our_line", "peak_by_line"):
        print(f"  {key} (trace peak {r.get('trace_peak_gib', float('nan')):.2f} GiB):")
        for where, gib in r.get(key, [])[:15]:
            print(f"    {gib:8.3f}  {where}")


def interleaved(args, model, sequences, device, progress, partial=None) -> list[dict]:
    """``--interleave``: after one warm-up of the tree (the packed path's first call warms itself up), the tree's
    timed runs and the packed path's timed passes alternate, ``--repeats`` of each; returns the tree's row and the
    packed path's, shaped as without interleaving (``interleaved: True`` in both). ``partial`` gets the seconds so
    far after each pair."""
    keep, stored, matmul = args.keep_attention[0], args.stored_layers[0], args.matmul_layers[0]
    matmul_layers = checkpointing(model, keep, stored, matmul)
    budget, cap = args.budget[0] or None, packed_cap(args, sequences)
    warm = run(model, sequences, budget, device, history=False, attention=args.attention,
               recompute=not args.no_recompute)
    print(f"tree warm-up run (compilation, autotuning): {warm['seconds']:.2f} s", flush=True)
    trees, passes = [], []
    for i in range(max(args.repeats, 1)):
        trees.append(run(model, sequences, budget, device, history=False, attention=args.attention,
                         recompute=not args.no_recompute))
        print(f"tree run {i}: {trees[-1]['seconds']:.3f} s, peak {trees[-1]['peak_gib']:.1f} GiB, reserved "
              f"{trees[-1]['reserved_gib']:.1f}, {trees[-1]['alloc_retries']} allocator retries", flush=True)
        passes.append(packed_groups(model, sequences, cap, device, args.attention, progress=progress, repeats=1,
                                    warmup=args.packed_warmup if i == 0 else "none"))
        if partial is not None:  # what a time limit would otherwise take with it
            partial(dict(tree_seconds=[t["seconds"] for t in trees], packed_seconds=[p["seconds"] for p in passes],
                         tree_alloc_retries=[t["alloc_retries"] for t in trees],
                         packed_alloc_retries=[p["alloc_retries"] for p in passes], warmup_seconds=warm["seconds"]))
    tree = dict(tree_row(model, trees, args.kernels[0], keep, stored, matmul, matmul_layers), interleaved=True)
    return [tree, dict(packed_groups=dict(merge_passes(passes, sequences), interleaved=True))]


def add_throughput(rows: list[dict], model, sequences) -> None:
    """Each tree row and the packed path's total get ``throughput``: model FLOPs of their work, MFU / HFU, unique
    and path tokens/s and the FLOP ratio (:mod:`model_flops`), and the tree rows the fraction of the FLOP ratio
    their speed-up over the packed path reaches; printed as a table."""
    from harts_hf.trees import PrefixForest

    stats = PrefixForest.from_sequences(sequences).pack().stats()
    packed = next((r["packed_groups"] for r in rows if "packed_groups" in r), None)
    if packed is not None:
        packed["throughput"] = forest_throughput(model, packed["seconds"], stats, tree=False,
                                                 attention_recomputed=packed.get("keep_attention") != "on")
    for row in (r for r in rows if r.get("pieces") is not None):
        row["throughput"] = forest_throughput(model, row["seconds"], stats, tree=True,
                                              checkpointed=row.get("recomputing_matmuls", row.get("checkpointed_layers")),
                                              attention_recomputed=row.get("keep_attention") != "on")
        if packed is not None:
            row["speedup_vs_packed"] = packed["seconds"] / row["seconds"]
            row["fraction_of_flop_ratio"] = row["speedup_vs_packed"] / row["throughput"]["flop_ratio"]
    print(f"{'path':22s} {'seconds':>8s} {'speed-up':>8s} {'FLOP ratio':>10s} {'fraction':>8s} {'MFU':>6s} "
          f"{'HFU':>6s} {'unique tok/s':>12s} {'path tok/s':>12s} {'peak GiB':>8s}")
    trees = [(f"tree {r.get('kernels', '')} {r['budget'] or 'all'} a{r.get('keep_attention', '')} "
              f"s{r.get('stored_layers', 0)}" + (f" m{r['matmul_layers']}" if r.get("matmul_layers") else ""), r)
             for r in rows if r.get("pieces") is not None]
    for name, row in [("packed per-trajectory", packed)] + trees:
        if row is None:
            continue
        t = row["throughput"]
        speedup, fraction = row.get("speedup_vs_packed", 1.0), row.get("fraction_of_flop_ratio")
        print(f"{name:22s} {row['seconds']:8.2f} {speedup:8.2f} {t['flop_ratio']:10.2f} "
              f"{'' if fraction is None else f'{fraction:.3f}':>8s} {t['mfu']:6.3f} {t['hfu']:6.3f} "
              f"{t['unique_tokens_per_s']:12.0f} {t['path_tokens_per_s']:12.0f} {row['peak_gib']:8.1f}", flush=True)


if __name__ == "__main__":
    main()
