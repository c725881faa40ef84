"""Which attention kernel is fastest per attended pair at the 2B model's head shapes on this GPU (fwd+bwd).

    python3 benchmarks/attention_kernels.py --out results/attention     # on the H200

16 query heads, 2 KV heads, head_dim 256, bf16. For causal square sequences (the per-trajectory baseline's shape)
and for a block of queries against a longer block of keys without a mask (a tree run against its ancestors), it
times SDPA with its default choice and with each backend forced, and torch's flash ``varlen_attn``, and lists the
kernels SDPA's default runs. Writes ``OUT/attention_kernels.json`` and prints a table (pairs per second).

``--runs N LQ LK`` (repeatable) times instead the shape of a tree's attention through torch's flash ``varlen_attn``:
N runs in ONE call, each a block of LQ queries against LK keys (its ancestors, then itself), causal aligned
bottom-right, as ``tree_attention_varlen`` calls it; beside it the same pairs split in two calls (each run's queries
against their own block, causal, and against the ancestors only, maskless: a lower bound on a split whose partial
results a log-sum-exp merge would join, the merge not timed), and square causal sequences of LK tokens (the
per-trajectory baseline's shape) for the per-pair rate to compare with. ``--heads HQ HKV D`` sets the head shape
(default the 2B preset's; the Nemotron-H-shaped preset has 16 8 128).

``--forest WORKLOAD SCALE`` (repeatable) checks and times the tree attention of a workload's whole forest: the plain
varlen call (every run's root-to-run keys gathered) against key segments shared by many runs attended in place
(``tree_attention.varlen.SHARED_KEYS_IN_PLACE``) and against FlexAttention on the packed rows (nothing gathered),
with their differences and, on small forests, each one's error against fp32 (``check_forest``). MLA's shape:
``--heads 32 32 192 --value-dim 128``; ``--factors`` sets the shared-keys cost factors tried (none: the plain call and
FlexAttention only); ``--fa4`` adds the plain call on FlashAttention-4, MLA's values padded and at their own width.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_kernels import bench  # noqa: E402

from harts_hf.kernels.tree_attention.varlen import gqa_keyword  # noqa: E402

HQ, HKV, D = 16, 2, 256


def kernels_of(function, top: int = 4) -> list:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        function()
        torch.cuda.synchronize()
    rows = [(e.key[:80], round(e.self_device_time_total / 1e3, 3)) for e in prof.key_averages()
            if e.self_device_time_total > 0]
    return sorted(rows, key=lambda r: -r[1])[:top]


def sdpa_call(q, k, v, causal: bool, backend):
    """fwd+bwd through SDPA ([1, H, L, D]); ``backend`` None = SDPA's own choice. GQA by ``enable_gqa``, or with
    the KV heads repeated where a backend refuses it."""
    from torch.nn.attention import sdpa_kernel

    def run(expand: bool):
        keys, values = (k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)) if expand else (k, v)
        out = F.scaled_dot_product_attention(q, keys, values, is_causal=causal, enable_gqa=not expand)
        out.float().square().mean().backward()

    def call():
        if backend is None:
            return run(False)
        with sdpa_kernel(backend):
            try:
                return run(False)
            except RuntimeError:
                return run(True)
    return call


def varlen_call(varlen_attn, q, k, v, causal: bool):
    """fwd+bwd through flash ``varlen_attn`` on one sequence ([L, H, D]); causal is bottom-right aligned."""
    qv, kv, vv = (x[0].transpose(0, 1).detach().requires_grad_() for x in (q, k, v))
    Lq, Lk = qv.shape[0], kv.shape[0]
    cu_q = torch.tensor([0, Lq], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, Lk], dtype=torch.int32, device="cuda")
    window, gqa = (-1, 0) if causal else (-1, -1), gqa_keyword(varlen_attn)
    return lambda: varlen_attn(qv, kv, vv, cu_q, cu_k, Lq, Lk, window_size=window,
                               **gqa).float().square().mean().backward()


def varlen_runs(varlen_attn, runs: int, Lq: int, Lk: int, causal: bool) -> tuple:
    """fwd+bwd of ``runs`` blocks of ``Lq`` queries against ``Lk`` keys in one ``varlen_attn`` call (causal: aligned
    bottom-right) and its attended pairs."""
    make = lambda rows, heads: torch.randn(rows, heads, D, device="cuda", dtype=torch.bfloat16,  # noqa: E731
                                           requires_grad=True)
    q, k, v = make(runs * Lq, HQ), make(runs * Lk, HKV), make(runs * Lk, HKV)
    cu_q = torch.arange(runs + 1, device="cuda", dtype=torch.int32) * Lq
    cu_k = torch.arange(runs + 1, device="cuda", dtype=torch.int32) * Lk
    window, gqa = (-1, 0) if causal else (-1, -1), gqa_keyword(varlen_attn)
    per_run = Lq * (Lk - Lq) + Lq * (Lq + 1) / 2 if causal else Lq * Lk
    return (lambda: varlen_attn(q, k, v, cu_q, cu_k, Lq, Lk, window_size=window, **gqa).float().square().mean()
            .backward()), runs * per_run


def time_runs(varlen_attn, runs: int, Lq: int, Lk: int) -> dict:
    """The tree-run shape, its split into an own causal block and a maskless ancestor block, and square causal
    sequences of ``Lk`` tokens: seconds and pairs per second of each (fwd+bwd)."""
    whole, pairs = varlen_runs(varlen_attn, runs, Lq, Lk, causal=True)
    own, own_pairs = varlen_runs(varlen_attn, runs, Lq, Lq, causal=True)
    ancestors, ancestor_pairs = varlen_runs(varlen_attn, runs, Lq, Lk - Lq, causal=False)
    square, square_pairs = varlen_runs(varlen_attn, max(1, round(pairs / (Lk * (Lk + 1) / 2))), Lk, Lk, causal=True)
    row = dict(kind="runs", runs=runs, q=Lq, k=Lk, pairs=pairs, heads=[HQ, HKV, D])
    for name, call, count in (("tree_runs", whole, pairs), ("split_own", own, own_pairs),
                              ("split_ancestors", ancestors, ancestor_pairs), ("square_causal", square, square_pairs)):
        seconds = bench(call)
        row[name] = dict(seconds=seconds, pairs=count, pairs_per_s=count / seconds)
        print("runs", runs, Lq, Lk, name, row[name], flush=True)
    split = row["split_own"]["seconds"] + row["split_ancestors"]["seconds"]
    row["split_pairs_per_s"] = pairs / split
    print(f"runs {runs} x {Lq} vs {Lk}: tree-run call {row['tree_runs']['pairs_per_s']:.3e} pairs/s, split "
          f"{row['split_pairs_per_s']:.3e} (merge not timed), square causal {row['square_causal']['pairs_per_s']:.3e}",
          flush=True)
    return row


def _errors(a: torch.Tensor, b: torch.Tensor) -> dict:
    """|a - b| over the largest |b| (p50, p99, max), in fp32."""
    diff = (a.float() - b.float()).abs().flatten()
    scale = b.float().abs().max().clamp_min(1e-30)
    picks = diff[torch.randint(diff.numel(), (min(diff.numel(), 1 << 24),), device=diff.device)]
    return {name: (value / scale).item() for name, value in
            (("p50", picks.quantile(0.5)), ("p99", picks.quantile(0.99)), ("max", diff.max()))}


def _same_width(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` and ``b`` cut to the narrower one's last dimension (FlexAttention's values are not padded)."""
    width = min(a.shape[-1], b.shape[-1])
    return a[..., :width], b[..., :width]


def _timed_against_plain(step, inputs, plain) -> tuple[dict, list]:
    """fwd+bwd seconds of a warm ``step`` (after a peak reset) and its peak, its outputs' and input gradients'
    difference from ``plain`` (the plain call's), and those outputs and gradients."""
    torch.cuda.reset_peak_memory_stats()
    entry = dict(seconds=bench(step), peak_gib=torch.cuda.max_memory_allocated() / 2**30)
    got = [step().detach()] + [x.grad.detach() for x in inputs]
    entry["vs_plain"] = {part: _errors(*_same_width(a, b)) for part, a, b in zip(("out", "dq", "dk", "dv"), got, plain)}
    return entry, got


def check_flex(row: dict, results: dict, packed, q, k, v, weight, keep: bool, dynamic: bool) -> None:
    """FlexAttention on the packed rows (:mod:`harts_hf.kernels.tree_attention.flex`, nothing gathered; values at
    their own width), compiled for this length or (``dynamic``) for any: the block tables' build time, the first
    call's seconds (compilation: a second forest shows what a new length costs), fwd+bwd seconds after it, peak, and
    its outputs' and gradients' difference from the plain call's, into ``row["flex"]`` / ``row["flex_dynamic"]``."""
    import time

    from harts_hf.kernels.tree_attention import flex

    name, default = "flex_dynamic" if dynamic else "flex", flex.DYNAMIC
    flex.DYNAMIC = dynamic
    torch.cuda.synchronize()
    begin = time.perf_counter()
    tables = flex.flex_block_tables(packed.subtree_end)
    torch.cuda.synchronize()
    entry = dict(tables_seconds=time.perf_counter() - begin,
                 blocks=int(tables["kv_num_blocks"].sum()), full_blocks=int(tables["full_kv_num_blocks"].sum()),
                 all_blocks=(tables["rows"] // flex.BLOCK) ** 2)
    inputs = [x.detach().clone().requires_grad_() for x in (q, k, v)]

    def step():
        for x in inputs:
            x.grad = None
        out = flex.tree_attention_flex(*inputs, packed.subtree_end, tables=tables)
        (out.float() * weight).sum().backward()
        return out

    try:
        begin = time.perf_counter()
        step()
        torch.cuda.synchronize()
        entry["first_call_seconds"] = time.perf_counter() - begin
        timed, got = _timed_against_plain(step, inputs, results["plain"])
        entry.update(timed)
        if keep:
            results[name] = got
    except Exception as error:  # a shape FlexAttention refuses on this card: say which and why
        entry["error"] = f"{type(error).__name__}: {str(error)[:400]}"
    flex.DYNAMIC = default
    row[name] = entry
    print(row["workload"], row["scale"], name, entry, flush=True)


def check_fa4(row: dict, results: dict, layout, q, k, v, value_dim: int, weight, keep: bool,
              factors=()) -> None:
    """The plain varlen call on FlashAttention-4 (``varlen.KERNEL = "fa4"``): values zero-padded to the key width as
    for torch's flash call (``fa4_padded``) and, where ``value_dim`` is narrower, at their own width (``fa4``, what
    ``tree_attention`` passes it where FlashAttention-4 takes the widths: :func:`fa4.takes_value_width`), then shared
    key segments attended in place on it at each cost factor of ``factors`` (``fa4_shared_keys_<factor>``, values at
    their own width), each entry's fwd+bwd seconds, peak and difference from the plain call's, into ``row``."""
    from harts_hf.kernels.tree_attention import shared_keys, varlen

    default, default_factor = varlen.KERNEL, shared_keys.COST_FACTOR
    varlen.KERNEL = "fa4"
    own = (v[..., :value_dim], weight[..., :value_dim])
    for name, factor, (values, weights) in (("fa4_padded", None, (v, weight)), ("fa4", None, own),
                                            *((f"fa4_shared_keys_{f:g}", f, own) for f in factors)):
        if name == "fa4" and value_dim == v.shape[-1]:
            continue
        varlen.SHARED_KEYS_IN_PLACE = factor is not None
        if factor is not None:
            shared_keys.COST_FACTOR = factor
        inputs = [x.detach().clone().requires_grad_() for x in (q, k, values)]

        def step(inputs=inputs, weights=weights):
            for x in inputs:
                x.grad = None
            out = varlen.tree_attention_varlen(*inputs, layout)
            (out.float() * weights).sum().backward()
            return out

        try:
            step()  # compiles on a new shape
            entry, got = _timed_against_plain(step, inputs, results["plain"])
            if keep:
                results[name] = got
        except Exception as error:  # a FlashAttention-4 that refuses these widths on this card: say which and why
            entry = dict(error=f"{type(error).__name__}: {str(error)[:400]}")
        if factor is not None:
            split = shared_keys.shared_segment_split(layout, q[0].numel() / (k[0].numel() + values[0].numel()))
            entry.update(rest_rows=split.rest.key_index.numel(), blocks=len(split.blocks))
        row[name] = entry
        print(row["workload"], row["scale"], name, entry, flush=True)
    varlen.KERNEL, varlen.SHARED_KEYS_IN_PLACE, shared_keys.COST_FACTOR = default, False, default_factor


def check_forest(workload: str, scale: float, value_dim: int, factors=(0.5, 2.0, 8.0),
                 reference_tokens: int = 20000, flex: bool = True, fa4: bool = False) -> dict:
    """The tree attention of a workload's forest (bf16 on CUDA, random q/k/v at ``--heads``, values ``value_dim`` wide
    and zero-padded to the key width as harts_hf pads MLA's): the plain varlen call against shared key segments attended
    in place (``varlen.SHARED_KEYS_IN_PLACE``) at each ``shared_keys.COST_FACTOR`` of ``factors`` and against the plain
    call with its gathers' gradients summed by fp32 ``index_add_`` (``plain_index_add``; ``plain`` and the others take
    the default, ``varlen.GATHER_SUM = "rows"``: the Triton kernel on CUDA, ``index_add_`` on the CPU; runs before
    2026-12-06 named ``index_add_`` ``plain`` and the kernel ``plain_row_sum``): fwd+bwd seconds and
    peak of each, the split's gathered rows and blocks, each split's outputs' and input gradients' difference from the
    plain call's, and, for forests of at most ``reference_tokens`` unique tokens, each path's error against an fp32 run
    of the per-run SDPA path; on CUDA with ``flex``, FlexAttention on the packed rows likewise (:func:`check_flex`),
    and with ``fa4`` the plain call on FlashAttention-4, values padded and not (:func:`check_fa4`)."""
    from harts_hf.kernels.tree_attention import shared_keys, tree_attention, varlen
    from harts_hf.trees import PrefixForest
    from harts_hf.workloads import make_workload

    device, dtype = (torch.device("cuda"), torch.bfloat16) if torch.cuda.is_available() else (torch.device("cpu"),
                                                                                               torch.float64)
    packed = PrefixForest.from_sequences(make_workload(workload, scale=scale, seed=0).sequences).pack().to(device)
    layout = varlen.build_varlen_layout(packed).to(device)
    U = packed.num_tokens
    torch.manual_seed(0)
    q = torch.randn(U, HQ, D, device=device, dtype=dtype)
    k = torch.randn(U, HKV, D, device=device, dtype=dtype)
    v = torch.randn(U, HKV, D, device=device, dtype=dtype)
    v[..., value_dim:] = 0
    weight = torch.randn(U, HQ, D, device=device, dtype=dtype)
    default_factor = shared_keys.COST_FACTOR
    peak = torch.cuda.max_memory_allocated if device.type == "cuda" else (lambda: float("nan"))
    row = dict(kind="forest", workload=workload, scale=scale, unique_tokens=U, heads=[HQ, HKV, D], value_dim=value_dim,
               gathered_rows=layout.key_index.numel())
    results = {}
    default_sum = varlen.GATHER_SUM
    for factor in (None, "index_add", *factors):
        name = "plain" if factor is None else "plain_index_add" if factor == "index_add" else f"shared_keys_{factor:g}"
        varlen.SHARED_KEYS_IN_PLACE = factor not in (None, "index_add")
        varlen.GATHER_SUM = "index_add" if factor == "index_add" else default_sum
        if varlen.SHARED_KEYS_IN_PLACE:
            shared_keys.COST_FACTOR = factor
            split = shared_keys.shared_segment_split(layout, (HQ * D) / (2 * HKV * D))
            row[name] = dict(rest_rows=split.rest.key_index.numel(), blocks=len(split.blocks),
                             block_query_rows=sum(b[1] - b[0] for b in split.blocks))
        inputs = [x.detach().clone().requires_grad_() for x in (q, k, v)]

        def step(inputs=inputs):
            for x in inputs:
                x.grad = None
            out = varlen.tree_attention_varlen(*inputs, layout)
            (out.float() * weight).sum().backward()
            return out

        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        row.setdefault(name, {}).update(seconds=bench(step), peak_gib=peak() / 2**30)
        results[name] = [step().detach()] + [x.grad.detach() for x in inputs]
        if name != "plain":
            row[name]["vs_plain"] = {part: _errors(a, b) for part, a, b in
                                     zip(("out", "dq", "dk", "dv"), results[name], results["plain"])}
            if U > reference_tokens:  # no fp32 reference at this size: free its outputs now (80 GB cards)
                del results[name]
        print(workload, scale, name, row[name], flush=True)
    varlen.SHARED_KEYS_IN_PLACE, varlen.GATHER_SUM = False, default_sum
    shared_keys.COST_FACTOR = default_factor
    if flex and device.type == "cuda":
        for dynamic in (False, True):
            check_flex(row, results, packed, q, k, v[..., :value_dim], weight[..., :value_dim], U <= reference_tokens,
                       dynamic)
    if fa4 and device.type == "cuda":
        check_fa4(row, results, layout, q, k, v, value_dim, weight, U <= reference_tokens, factors)
    if U <= reference_tokens:
        inputs = [x.detach().float().requires_grad_() for x in (q, k, v)]
        out = tree_attention(*inputs, packed.subtree_end, backend="runs", layout=layout)
        (out * weight.float()).sum().backward()
        exact = [out.detach()] + [x.grad for x in inputs]
        for name in results:
            row[name]["vs_fp32"] = {part: _errors(*_same_width(a, b)) for part, a, b in
                                    zip(("out", "dq", "dk", "dv"), results[name], exact)}
    print(json.dumps(row), flush=True)
    return row


def main():
    global HQ, HKV, D
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="results/attention")
    parser.add_argument("--heads", type=int, nargs=3, default=[HQ, HKV, D], metavar=("HQ", "HKV", "D"))
    parser.add_argument("--runs", type=int, nargs=3, action="append", metavar=("N", "LQ", "LK"),
                        help="only the tree-run shape: N runs of LQ queries against LK keys in one varlen call (see "
                             "the module doc); repeatable")
    parser.add_argument("--forest", nargs=2, action="append", metavar=("WORKLOAD", "SCALE"),
                        help="only the tree attention of a workload's forest, plain against shared keys in place "
                             "(see check_forest); repeatable")
    parser.add_argument("--value-dim", type=int, default=None,
                        help="with --forest: the values' real width (MLA's 128 under keys of 192); default D")
    parser.add_argument("--factors", type=float, nargs="*", default=[0.5, 2.0, 8.0],
                        help="with --forest: the shared-keys cost factors to try (none: the plain call and "
                             "FlexAttention only)")
    parser.add_argument("--no-flex", action="store_true", help="with --forest: no FlexAttention rows")
    parser.add_argument("--fa4", action="store_true",
                        help="with --forest: FlashAttention-4 rows too, values padded to the key width and not")
    parser.add_argument("--causal", type=int, nargs="+", default=[16384, 49152])
    parser.add_argument("--cross", type=int, nargs=2, action="append", metavar=("Q", "K"),
                        help="query and key lengths of a maskless block (default: 8192 43008 and 1024 43008)")
    args = parser.parse_args()
    HQ, HKV, D = args.heads
    from run_record import write_run_record
    from torch.nn.attention import SDPBackend
    from torch.nn.attention.varlen import varlen_attn

    out = Path(args.out)
    write_run_record(out)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "cudnn_sdp_enabled": torch.backends.cuda.cudnn_sdp_enabled(), "rows": []}
    if args.forest:
        for workload, scale in args.forest:
            results["rows"].append(check_forest(workload, float(scale), args.value_dim or D, tuple(args.factors),
                                                flex=not args.no_flex, fa4=args.fa4))
            (out / "attention_kernels.json").write_text(json.dumps(results, indent=1))
            torch.cuda.empty_cache()
        return
    if args.runs:
        for runs, Lq, Lk in args.runs:
            if not 0 < Lq < Lk:
                parser.error(f"--runs {runs} {Lq} {Lk}: each run needs 0 < LQ < LK (ancestors before its queries)")
            results["rows"].append(time_runs(varlen_attn, runs, Lq, Lk))
            (out / "attention_kernels.json").write_text(json.dumps(results, indent=1))
            torch.cuda.empty_cache()
        return
    make = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)  # noqa: E731
    backends = {"sdpa_default": None, "sdpa_flash": SDPBackend.FLASH_ATTENTION,
                "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}
    shapes = [("causal", L, L) for L in args.causal] + [("cross", q, k) for q, k in
                                                         (args.cross or [(8192, 43008), (1024, 43008)])]
    for kind, Lq, Lk in shapes:
        causal = kind == "causal"
        pairs = Lq * (Lq + 1) / 2 if causal else Lq * Lk
        q, k, v = make(1, HQ, Lq, D), make(1, HKV, Lk, D), make(1, HKV, Lk, D)
        calls = {name: sdpa_call(q, k, v, causal, backend) for name, backend in backends.items()}
        calls["varlen_flash"] = varlen_call(varlen_attn, q, k, v, causal)
        row = dict(kind=kind, q=Lq, k=Lk, pairs=pairs)
        for name, call in calls.items():
            try:
                seconds = bench(call)
                row[name] = dict(seconds=seconds, pairs_per_s=pairs / seconds,
                                 tflops=pairs * HQ * D * 4 * 3.5 / seconds / 1e12)
                if name == "sdpa_default":
                    row[name]["kernels"] = kernels_of(call)
            except Exception as error:  # a backend that refuses these shapes: say which and why
                row[name] = dict(error=f"{type(error).__name__}: {str(error)[:300]}")
            print(kind, Lq, Lk, name, {k_: v_ for k_, v_ in row[name].items() if k_ != "kernels"}, flush=True)
        print("  sdpa default kernels:", row["sdpa_default"].get("kernels"), flush=True)
        results["rows"].append(row)
        (out / "attention_kernels.json").write_text(json.dumps(results, indent=1))
        q = k = v = calls = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
