"""torch's flash ``varlen_attn`` past 2^31 query elements, and the tree path's split calls (CUDA).

    python3 benchmarks/varlen_limits.py --out $OUT/limits      # on the H200

64 unrelated sequences of 9,000 tokens (576,000 rows; 16 query heads / 2 KV heads of 256: 2.36e9 query elements,
the last sequences start past row 524,288 = 2^31 / 4,096) as one forest:
1. one ``varlen_attn`` call over all of them, forward and backward (a child process: an illegal address ends the
   CUDA context); what ran, and the last sequence's output / dq error against SDPA on that sequence alone;
2. ``tree_attention(backend="varlen")``, which cuts the runs into calls below ``MAX_CALL_ELEMENTS``: the last
   sequence's output and q/k/v gradients against SDPA on that sequence alone (both bf16), and the first sequence's.
Writes ``OUT/varlen_limits.json``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_kernels import rel  # noqa: E402

SEQUENCES, LENGTH, HQ, HKV, D = 64, 9_000, 16, 2, 256


def inputs():
    torch.manual_seed(0)
    U = SEQUENCES * LENGTH
    make = lambda h: torch.randn(U, h, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)  # noqa: E731
    return make(HQ), make(HKV), make(HKV)


def alone(q, k, v, weight, index: int):
    """SDPA causal on sequence ``index`` alone: output and q/k/v gradients of ``sum(out * weight[its rows])``."""
    rows = slice(index * LENGTH, (index + 1) * LENGTH)
    parts = [x[rows].detach().transpose(0, 1).unsqueeze(0).requires_grad_() for x in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(*parts, is_causal=True, enable_gqa=True)
    out = out[0].transpose(0, 1)
    grads = torch.autograd.grad((out.float() * weight[rows]).sum(), parts)
    return [out] + [g[0].transpose(0, 1) for g in grads]


def output_weight():
    generator = torch.Generator(device="cuda").manual_seed(1)
    return torch.randn(SEQUENCES * LENGTH, HQ, D, device="cuda", generator=generator)


def one_call(queue) -> None:
    from torch.nn.attention.varlen import varlen_attn

    from harts_hf.kernels.tree_attention.varlen import gqa_keyword

    try:
        q, k, v = inputs()
        cu = torch.arange(0, SEQUENCES + 1, device="cuda", dtype=torch.int32) * LENGTH
        out = varlen_attn(q, k, v, cu, cu, LENGTH, LENGTH, window_size=(-1, 0), **gqa_keyword(varlen_attn))
        torch.cuda.synchronize()
        weight = output_weight()
        last = alone(q, k, v, weight, SEQUENCES - 1)
        report = {"forward_ran": True, "last_out_rel": rel(out[-LENGTH:], last[0])}
        queue.put(report)  # kept if the backward ends the process
        dq = torch.autograd.grad((out.float() * weight).sum(), q)[0]
        torch.cuda.synchronize()
        queue.put(dict(report, backward_ran=True, last_dq_rel=rel(dq[-LENGTH:], last[1])))
    except Exception as error:  # noqa: BLE001 (report what the kernel did)
        queue.put({"error": f"{type(error).__name__}: {str(error).splitlines()[0]}"})


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="results/limits")
    args = parser.parse_args()
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "rows": SEQUENCES * LENGTH, "query_elements": SEQUENCES * LENGTH * HQ * D}
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=one_call, args=(queue,))
    child.start()
    child.join()
    reports = []
    while not queue.empty():
        reports.append(queue.get())
    results["one_varlen_call"] = dict(exit=child.exitcode, reports=reports)
    print("one varlen call:", results["one_varlen_call"], flush=True)

    from harts_hf.kernels import tree_attention
    from harts_hf.kernels.tree_attention.varlen import (
        MAX_CALL_ELEMENTS,
        build_varlen_layout,
        varlen_call_groups,
    )
    from harts_hf.trees import PrefixForest

    packed = PrefixForest.from_sequences([[s] * LENGTH for s in range(SEQUENCES)]).pack()
    layout = build_varlen_layout(packed).to("cuda")
    cu_q, cu_k = layout.host_cu()
    results["tree_calls"] = len(varlen_call_groups(cu_q, cu_k, HQ * D, HKV * D))
    q, k, v = inputs()
    out = tree_attention(q, k, v, packed.subtree_end.cuda(), backend="varlen", layout=layout)
    weight = output_weight()
    grads = torch.autograd.grad((out.float() * weight).sum(), (q, k, v))
    for index in (0, SEQUENCES - 1):
        rows = slice(index * LENGTH, (index + 1) * LENGTH)
        reference = alone(q, k, v, weight, index)
        results[f"tree_split_sequence_{index}"] = {name: rel(mine[rows], theirs) for name, mine, theirs in
                                                   zip(("out", "dq", "dk", "dv"), (out,) + grads, reference)}
    results["max_call_elements"] = MAX_CALL_ELEMENTS
    print(json.dumps(results, indent=1), flush=True)
    from run_record import write_run_record

    out_dir = Path(args.out)
    write_run_record(out_dir)
    (out_dir / "varlen_limits.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
