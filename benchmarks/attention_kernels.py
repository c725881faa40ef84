"""Which attention kernel is fastest per attended pair at the 2B model's head shapes on this GPU (fwd+bwd).

    python3 benchmarks/attention_kernels.py --out results/attention     # on the H200

16 query heads, 2 KV heads, head_dim 256, bf16. For causal square sequences (the per-trajectory baseline's shape)
and for a block of queries against a longer block of keys without a mask (a tree run against its ancestors), it
times SDPA with its default choice and with each backend forced, and torch's flash ``varlen_attn``, and lists the
kernels SDPA's default runs. Writes ``OUT/attention_kernels.json`` and prints a table (pairs per second).
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


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="results/attention")
    parser.add_argument("--causal", type=int, nargs="+", default=[16384, 49152])
    parser.add_argument("--cross", type=int, nargs=2, action="append", metavar=("Q", "K"),
                        help="query and key lengths of a maskless block (default: 8192 43008 and 1024 43008)")
    args = parser.parse_args()
    from run_record import write_run_record
    from torch.nn.attention import SDPBackend
    from torch.nn.attention.varlen import varlen_attn

    out = Path(args.out)
    write_run_record(out)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "cudnn_sdp_enabled": torch.backends.cuda.cudnn_sdp_enabled(), "rows": []}
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
