"""The packed per-trajectory path, the baseline of every tree timing: consecutive trajectories packed into one
forward each (every trajectory its own tree: the tree's kernels, no padding, no sharing), timed call by call, and
the ``c + a tokens + b pairs`` fit over its calls (``plan_memory_probe.py --packed-groups``).
"""

from __future__ import annotations

import time

import numpy as np
import torch
from bench_tree_vs_trajectory import run_tree


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def alloc_retries(device) -> int:
    """The caching allocator's count of failed allocations it retried after freeing its cached blocks (each a
    synchronising ``cudaFree`` of the cache: a run near the memory limit that pays them is slower for it)."""
    return torch.cuda.memory_stats(device).get("num_alloc_retries", 0) if device.type == "cuda" else 0


def timed_run(model, forest, device, attention: str, zero_grad: bool = True) -> float:
    """Seconds of one fwd+bwd of ``forest`` (``tree_logprobs`` under bf16 autocast, as the tree run and the
    trainer); ``zero_grad=False``: into the gradients already there."""
    sync(device)
    start = time.perf_counter()
    with torch.autocast(device.type, dtype=torch.bfloat16):
        run_tree(model, forest, attention, zero_grad=zero_grad)
    sync(device)
    return time.perf_counter() - start


def two_runs(model, forest, device, attention: str, zero_grad: bool = True) -> tuple[float, float]:
    """Seconds of two :func:`timed_run` calls in a row (the first compiles / autotunes new lengths)."""
    return tuple(timed_run(model, forest, device, attention, zero_grad) for _ in range(2))


def second_run(model, forest, device, attention: str, zero_grad: bool = True) -> float:
    """Seconds of the second of :func:`two_runs`."""
    return two_runs(model, forest, device, attention, zero_grad)[1]


def consecutive_groups(sequences, max_tokens: int) -> list[list]:
    """Consecutive ``sequences`` in groups of at most ``max_tokens`` tokens (a longer sequence alone)."""
    groups, current = [], []
    for sequence in sequences:
        if current and sum(map(len, current)) + len(sequence) > max_tokens:
            groups.append(current)
            current = []
        current.append(sequence)
    groups.append(current)
    return groups


def packed_groups(model, sequences, max_tokens: int, device, attention: str = "auto", progress=None,
                  repeats: int = 1, warmup: str = "each", calls: slice | None = None) -> dict:
    """The strongest per-trajectory path at a size no single call holds: consecutive trajectories packed into ONE
    forward each (every trajectory its own tree: same kernels, no padding, no sharing; ``tree_logprobs`` as the
    bench's ``packed``) of at most ``max_tokens`` path tokens, fwd+bwd, the second of two runs timed (the first
    compiles / autotunes new shapes; its time is kept as ``first_seconds``). Gradients accumulate over the calls,
    as over a trainer's microbatches (and over the tree's pieces), so every call after the first peaks with them.
    Sum of the calls' seconds, the largest peak, and ``c + a tokens + b pairs`` fitted to the calls (least squares;
    pairs = sum L(L+1)/2) with the tree's price under it (:func:`packed_fit`). ``warmup="first"``: only the first
    call gets the untimed run (the others' ``first_seconds`` is None), one pass fewer where nothing compiles per
    call size (harts_hf's kernels with a warm kernel cache); ``"none"``: no untimed run (a pass after a warm one).
    ``calls``: time only that slice of the calls (each row keeps its index as ``call``; the first call of the slice
    gets the ``"first"`` warm-up), so that a path too long for one process can be timed in parts."""
    from harts_hf.trees import PrefixForest

    rows = []
    model.zero_grad(set_to_none=True)
    every = list(enumerate(consecutive_groups(sequences, max_tokens)))
    groups = every if calls is None else every[calls]
    if not groups:
        raise ValueError(f"calls={calls}: no packed call in it ({len(every)} calls of <= {max_tokens} tokens)")
    cuda = device.type == "cuda"  # on a CPU (the tests) no memory figures
    for index, group in groups:
        forest = PrefixForest.from_sequences(group, groups=list(range(len(group))))
        warm = warmup == "each" or (warmup == "first" and not rows)
        if cuda and warm:  # only before an untimed run: a timed one starts with the cache warm, as the tree's do
            torch.cuda.empty_cache()
        first = timed_run(model, forest, device, attention, zero_grad=False) if warm else None
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)  # the timed runs' peak (a warm-up's autotuning buffers left out)
        retries = alloc_retries(device)
        timed = [timed_run(model, forest, device, attention, zero_grad=False) for _ in range(repeats)]
        rows.append(dict(call=index, trajectories=len(group), tokens=sum(map(len, group)),
                         pairs=sum(len(s) * (len(s) + 1) / 2 for s in group), seconds=float(np.mean(timed)),
                         seconds_all=timed, first_seconds=first,
                         peak_gib=torch.cuda.max_memory_allocated(device) / 2**30 if cuda else float("nan"),
                         reserved_gib=torch.cuda.max_memory_reserved(device) / 2**30 if cuda else float("nan"),
                         alloc_retries=alloc_retries(device) - retries))
        print(f"packed call: {len(group)} trajectories, {rows[-1]['tokens']} tokens, {rows[-1]['seconds']:.3f} s (first run "
              f"{'none' if first is None else f'{first:.3f}'}), peak {rows[-1]['peak_gib']:.1f} GiB, reserved "
              f"{rows[-1]['reserved_gib']:.1f}, {rows[-1]['alloc_retries']} allocator retries", flush=True)
        if progress is not None:
            progress(rows)
    model.zero_grad(set_to_none=True)
    total = packed_total(rows, max_tokens, sequences)
    print(f"packed per-trajectory: {len(sequences)} trajectories in {len(rows)} calls of <= {max_tokens} tokens: "
          f"{total['seconds']:.2f} s (repeats {', '.join(f'{x:.2f}' for x in total['repeat_seconds'])}), peak {total['peak_gib']:.1f} GiB; fit c {total['fit'][0]:.4g} s, "
          f"a {total['fit'][1]:.4g} s/token, b {total['fit'][2]:.4g} s/pair; the tree priced "
          f"{total['tree_priced_seconds']:.2f} s, S_phys against this path {total['S_phys_packed']:.2f}", flush=True)
    return total


def packed_total(rows: list[dict], max_tokens: int, sequences) -> dict:
    """The packed path's result from its calls' rows: the sum of their seconds, each timed run's total over the calls,
    the largest peak, the allocator's retries and the ``c + a tokens + b pairs`` fit."""
    repeats = len(rows[0]["seconds_all"])
    return dict(calls=len(rows), call_range=[rows[0]["call"], rows[-1]["call"] + 1], max_tokens=max_tokens,
                seconds=sum(r["seconds"] for r in rows),
                repeat_seconds=[sum(r["seconds_all"][i] for r in rows) for i in range(repeats)],
                peak_gib=max(r["peak_gib"] for r in rows), alloc_retries=sum(r["alloc_retries"] for r in rows),
                groups=rows, **packed_fit(rows, sequences))


def join_parts(parts: list[list[dict]], sequences, max_tokens: int) -> dict:
    """The whole packed path from runs of its slices (``--packed-calls``; each part the calls' rows a run wrote):
    every call exactly once, each as the calls of ``max_tokens`` cut ``sequences`` (token count and trajectories),
    the same number of timed runs in each."""
    expected = consecutive_groups(sequences, max_tokens)
    rows = sorted((row for part in parts for row in part), key=lambda row: row["call"])
    calls = [row["call"] for row in rows]
    if calls != list(range(len(expected))):
        raise ValueError(f"the parts hold calls {calls}; the packed path of <= {max_tokens} tokens has calls 0.."
                         f"{len(expected) - 1}, each exactly once: run the missing ones with --packed-calls")
    for row, group in zip(rows, expected):
        if (row["tokens"], row["trajectories"]) != (sum(map(len, group)), len(group)):
            raise ValueError(f"call {row['call']}: {row['trajectories']} trajectories of {row['tokens']} tokens in "
                             f"the part, {len(group)} of {sum(map(len, group))} here: not the same workload or "
                             "--packed-groups")
    if len({len(row["seconds_all"]) for row in rows}) != 1:
        raise ValueError("the parts timed their calls a different number of times (--repeats): run them alike")
    return packed_total(rows, max_tokens, sequences)


def merge_passes(passes: list[dict], sequences) -> dict:
    """Packed passes of one timed run each (:func:`packed_groups` with ``repeats=1``) as one result with a run per
    pass: per call ``seconds_all`` over the passes, their mean and largest peak; ``repeat_seconds`` the passes'
    totals; the fit over the calls' means."""
    calls = []
    for i, call in enumerate(passes[0]["groups"]):
        runs = [p["groups"][i]["seconds"] for p in passes]
        calls.append(dict(call, seconds=float(np.mean(runs)), seconds_all=runs,
                          peak_gib=max(p["groups"][i]["peak_gib"] for p in passes),
                          alloc_retries=sum(p["groups"][i]["alloc_retries"] for p in passes)))
    return dict(passes[0], seconds=sum(c["seconds"] for c in calls), repeat_seconds=[p["seconds"] for p in passes],
                peak_gib=max(p["peak_gib"] for p in passes), alloc_retries=sum(c["alloc_retries"] for c in calls),
                groups=calls, **packed_fit(calls, sequences))


def packed_fit(rows: list[dict], sequences) -> dict:
    """``c + a tokens + b pairs`` fitted to the packed calls (``rows``: tokens, pairs, seconds) and the whole forest
    priced by it (one call over its unique tokens and tree pairs): ``S_phys_packed`` = the calls' seconds / that
    price, the speed-up a tree running at the packed path's own per-token and per-pair rates would reach. With
    fewer than three calls the fit is undetermined (NaN)."""
    from harts_hf.trees import PrefixForest

    stats = PrefixForest.from_sequences(sequences).pack().stats()
    if len(rows) < 3:
        fit = [float("nan")] * 3
    else:
        features = np.array([[1.0, r["tokens"], r["pairs"]] for r in rows])
        fit = np.linalg.lstsq(features, np.array([r["seconds"] for r in rows]), rcond=None)[0].tolist()
    c, a, b = fit
    priced = c + a * stats["unique_tokens"] + b * stats["tree_attention_pairs"]
    return dict(fit=fit, tree_priced_seconds=priced, S_phys_packed=sum(r["seconds"] for r in rows) / priced,
                unique_tokens=stats["unique_tokens"], tree_attention_pairs=stats["tree_attention_pairs"])
