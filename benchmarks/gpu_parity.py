"""GPU (bf16) parity and a first timing of tree execution against per-trajectory execution.

    python benchmarks/gpu_parity.py --out results/        # on the H200 (see ../shared/device/README.md)

1. Kernel: tree gated delta rule, backend "fla" (one varlen fla call per round) against "torch" (fp32) and
   against per-path fla calls, outputs and input gradients.
2. Model: a Qwen3-Next-style model in bf16; per-token log-prob differences and per-parameter gradient cosine of
   tree vs per-trajectory, next to per-trajectory vs its own rerun.
3. Timing: forward+backward of both paths on the same batch (gradient checkpointing on), with R_tok.
Prints a short table last and writes everything to <out>/gpu_parity.json.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path

import torch


def quantiles(values: torch.Tensor) -> dict:
    values = values.float().flatten().cpu()
    if values.numel() == 0:
        return {}
    q = torch.tensor([0.5, 0.9, 0.99, 1.0])
    return dict(zip(["p50", "p90", "p99", "max"], torch.quantile(values[:1_000_000], q).tolist()))


def kernel_parity(results: dict) -> None:
    import random

    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    from harts_hf.kernels import build_gated_delta_plan, tree_gated_delta_rule
    from harts_hf.trees import PrefixForest
    from tests.forests import random_tree_sequences

    sequences = random_tree_sequences(random.Random(0), 24, vocab=7, max_tail=700)
    packed = PrefixForest.from_sequences(sequences).pack().to("cuda")
    U, HK, HV, K, V = packed.num_tokens, 4, 8, 128, 128
    torch.manual_seed(0)
    make = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    q, k, v = make(U, HK, K).requires_grad_(), make(U, HK, K).requires_grad_(), make(U, HV, V).requires_grad_()
    g = (-torch.rand(U, HV, device="cuda") * 0.2).requires_grad_()
    beta = torch.rand(U, HV, device="cuda", dtype=torch.bfloat16).requires_grad_()
    inputs = (q, k, v, g, beta)
    weight = torch.randn(U, HV, V, device="cuda")

    def grads(out):
        return torch.autograd.grad((out.float() * weight).sum(), inputs)

    outs = {}
    for backend in ("fla", "torch"):
        plan = build_gated_delta_plan(packed.to("cpu"), final_states_only=backend == "fla").to("cuda")
        out = tree_gated_delta_rule(q, k, v, g, beta, plan, use_qk_l2norm_in_kernel=True, backend=backend)
        outs[backend] = (out, grads(out))
        results[f"kernel_plan_{backend}"] = plan.stats
    # per-path fla calls (zero initial state), scattered back by the first path through each token
    path_out = torch.zeros(U, HV, V, device="cuda", dtype=torch.float32)
    seen = torch.zeros(U, dtype=torch.bool, device="cuda")
    for i in range(packed.num_sequences):
        index = packed.sequence_index(i)
        leaf = [x[index].detach().clone().requires_grad_() for x in inputs]
        o, _ = chunk_gated_delta_rule(*(x.unsqueeze(0) for x in leaf), use_qk_l2norm_in_kernel=True)
        new = ~seen[index]
        path_out[index[new]] = o[0][new].float()
        seen[index] = True
    kernel = {}
    reference = outs["torch"][0].float()
    for name, value in (("fla_tree", outs["fla"][0].float()), ("fla_per_path", path_out)):
        kernel[f"{name}_vs_torch_fp32_out_rel"] = ((value - reference).norm() / reference.norm()).item()
    for j, name in enumerate(("q", "k", "v", "g", "beta")):
        a, b = outs["fla"][1][j].float(), outs["torch"][1][j].float()
        kernel[f"grad_{name}_fla_tree_vs_torch_rel"] = ((a - b).norm() / b.norm()).item()
    # tree attention: flash varlen over gathered ancestor paths vs dense-mask SDPA (fp32 reference)
    from harts_hf.kernels import build_varlen_layout, tree_attention

    layout = build_varlen_layout(packed.to("cpu")).to("cuda")
    qa = make(U, 16, 256).requires_grad_()
    ka, va = make(U, 2, 256).requires_grad_(), make(U, 2, 256).requires_grad_()
    fast = tree_attention(qa, ka, va, packed.subtree_end, backend="varlen", layout=layout)
    exact = tree_attention(qa.float(), ka.float(), va.float(), packed.subtree_end, backend="sdpa")
    kernel["attention_varlen_vs_fp32_rel"] = ((fast.float() - exact).norm() / exact.norm()).item()
    bf16_sdpa = tree_attention(qa, ka, va, packed.subtree_end, backend="sdpa")
    kernel["attention_sdpa_bf16_vs_fp32_rel"] = ((bf16_sdpa.float() - exact).norm() / exact.norm()).item()
    results["kernel"] = kernel


def build_model(hidden=1024, layers=8, vocab=151936):
    import transformers

    config = transformers.Qwen3NextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=8,
        linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * (layers // 4),
        mlp_only_layers=list(range(layers)), max_position_embeddings=262144, router_aux_loss_coef=0.0)
    torch.manual_seed(0)
    return spread_decays(transformers.Qwen3NextForCausalLM(config).to(device="cuda", dtype=torch.bfloat16))


def spread_decays(model):
    """Per-head decays exp(A_log) drawn in [0.01, 1] as in the CPU tests (transformers' init reaches 16, which
    leaves little state to hand over); returns ``model``."""
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "A_log"):
                module.A_log.copy_(torch.empty_like(module.A_log).uniform_(0.01, 1.0).log())
    return model


def per_trajectory(model, sequences, weights):
    """Each trajectory alone through the unpatched forward (transformers' fla kernels): log-probs + grads."""
    model.zero_grad(set_to_none=True)
    logprobs = []
    device = model.get_input_embeddings().weight.device
    for sequence, weight in zip(sequences, weights):
        ids = torch.tensor(sequence, device=device).unsqueeze(0)
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state[0, :-1]
        logits = model.lm_head(hidden).float()
        lp = logits.log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
        (lp * weight).sum().backward()
        logprobs.append(lp.detach())
    return torch.cat(logprobs), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def tree_path(model, sequences, weights, share=True):
    """One tree forward; ``share=False``: every sequence its own tree (the packed per-trajectory baseline, same
    kernels, no padding)."""
    from harts_hf import tree_logprobs
    from harts_hf.trees import PrefixForest

    model.zero_grad(set_to_none=True)
    forest = PrefixForest.from_sequences(sequences, groups=None if share else list(range(len(sequences))))
    out = tree_logprobs(model, forest=forest)
    sum((lp * w).sum() for lp, w in zip(out.logprobs, weights)).backward()
    return torch.cat([lp.detach() for lp in out.logprobs]), \
        {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}, out.stats


GATE_PARAMETERS = ("A_log", "dt_bias", "D")
"""Names (last component) of the recurrent layers' decay / step parameters, reported one by one."""


def model_parity(results: dict, scale: float, save=lambda: None, model=None, timing: bool = True,
                 sequences=None) -> None:
    """Log-probs and gradients of the tree and of the per-trajectory paths (one sequence per forward; the packed
    call) against an fp32 copy run per trajectory with transformers' pure-torch kernels. ``sequences``: the
    batch (default: the ``swe`` workload at ``scale``). Runs on the model's device (CPU for a smoke run)."""
    from harts_hf.logprobs import _ensure_patched
    from harts_hf.workloads import make_workload

    model = build_model() if model is None else model
    _ensure_patched(model)  # before its first forward, as tree_logprobs would: plain CPU forwards stay off Triton
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    if sequences is None:  # token ids below the model's vocabulary (Nemotron-H's is smaller than the default)
        sequences = make_workload("swe", scale=scale, seed=0, vocab_size=model.config.vocab_size).sequences
    device = model.get_input_embeddings().weight.device
    generator = torch.Generator(device=device).manual_seed(0)
    weights = [torch.randn(len(s) - 1, device=device, generator=generator) for s in sequences]
    stage = results.setdefault("model_stages", [])
    base_a, grads_a = per_trajectory(model, sequences, weights)
    base_b, grads_b = per_trajectory(model, sequences, weights)
    stage.append("per_trajectory x2")
    save()
    packed_base, grads_p, _ = tree_path(model, sequences, weights, share=False)
    stage.append("packed per_trajectory")
    save()
    tree, grads_t, stats = tree_path(model, sequences, weights)
    stage.append("tree")
    results["model_stats"] = stats
    save()
    # fp32 reference: the same weights in fp32 through the unpatched per-trajectory path
    import copy

    from harts_hf.reference import torch_reference_kernels

    reference = copy.deepcopy(model).float()  # patches follow the copy (bound methods)
    with torch_reference_kernels():  # transformers' pure-torch fp32 kernels: no fp32 Triton autotuning
        ref, grads_r = per_trajectory(reference, sequences, weights)
    del reference
    stage.append("fp32 reference")
    save()

    def cosines(x, y):
        return torch.tensor([torch.nn.functional.cosine_similarity(x[n].flatten().float(), y[n].flatten().float(), 0).item()
                             for n in x])

    results["model_parity"] = {
        "stats": stats,
        "logprob_absdiff_tree_vs_baseline": quantiles((tree - base_a).abs()),
        "logprob_absdiff_baseline_rerun": quantiles((base_b - base_a).abs()),
        "logprob_absdiff_vs_fp32": {"tree": quantiles((tree - ref).abs()), "per_trajectory": quantiles((base_a - ref).abs()),
                                    "packed_per_trajectory": quantiles((packed_base - ref).abs())},
        "grad_one_minus_cosine_vs_fp32": {"tree": quantiles(1 - cosines(grads_t, grads_r)),
                                          "per_trajectory": quantiles(1 - cosines(grads_a, grads_r)),
                                          "packed_per_trajectory": quantiles(1 - cosines(grads_p, grads_r))},
        "grad_one_minus_cosine_tree_vs_baseline": quantiles(1 - cosines(grads_t, grads_a)),
        "grad_one_minus_cosine_rerun": quantiles(1 - cosines(grads_b, grads_a)),
        "gate_parameters_vs_fp32": gate_parameter_errors(
            {"tree": grads_t, "per_trajectory": grads_a, "packed_per_trajectory": grads_p}, grads_r),
    }
    if not timing or device.type != "cuda":
        return
    # timing (fwd + bwd), warm
    timings = {}
    for name, run in (("per_trajectory", lambda: per_trajectory(model, sequences, weights)),
                      ("packed_per_trajectory", lambda: tree_path(model, sequences, weights, share=False)),
                      ("tree", lambda: tree_path(model, sequences, weights))):
        run()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        for _ in range(2):
            run()
        torch.cuda.synchronize()
        timings[name] = {"seconds": (time.perf_counter() - start) / 2,
                         "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
    timings["speedup_vs_per_trajectory"] = timings["per_trajectory"]["seconds"] / timings["tree"]["seconds"]
    timings["speedup_vs_packed"] = timings["packed_per_trajectory"]["seconds"] / timings["tree"]["seconds"]
    results["timing"] = timings


def gate_parameter_errors(paths: dict, reference: dict) -> dict:
    """Per path: the worst relative error (L2) and 1 - cosine over the layers of each gate parameter
    (:data:`GATE_PARAMETERS`) of the model, against ``reference``'s gradients."""
    report = {}
    for path, grads in paths.items():
        for kind in GATE_PARAMETERS:
            names = [n for n in reference if n.rsplit(".", 1)[-1] == kind and n in grads]
            if not names:
                continue
            rel = [((grads[n].float() - reference[n].float()).norm() / reference[n].float().norm().clamp(min=1e-30)).item()
                   for n in names]
            cos = [1 - torch.nn.functional.cosine_similarity(grads[n].flatten().float(), reference[n].flatten().float(),
                                                             0).item() for n in names]
            report.setdefault(path, {})[kind] = {"layers": len(names), "max_rel": max(rel), "max_one_minus_cosine": max(cos)}
    return report


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="results")
    parser.add_argument("--scale", type=float, default=0.01)
    parser.add_argument("--skip", nargs="*", default=[], choices=["kernel", "model"])
    parser.add_argument("--preset", default=None,
                        help="a model preset of bench_tree_vs_trajectory.py (e.g. qwen3_next_2b_4layers, the ~2B "
                             "layer shapes in 4 layers) instead of the 8-layer hidden-1024 model; bf16, decays spread")
    parser.add_argument("--family", default="qwen3_next", choices=["qwen3_next", "qwen3_5"])
    parser.add_argument("--no-timing", dest="timing", action="store_false", help="parity only")
    parser.add_argument("--mamba-scan", default="cuda", choices=["cuda", "fp32", "half"],
                        help="Mamba-2 presets: the dtype of the scan's C, B and dt x in the tree and packed paths "
                             "(harts_hf.model_patches.mamba2.SCAN_INPUTS: 'cuda', the default, is 'half' on the GPU; "
                             "the per-trajectory path is transformers' own)")
    parser.add_argument("--mamba-chunk", type=int, default=None,
                        help="Mamba-2 presets: the scan's chunk grid in the tree and packed paths "
                             "(harts_hf.model_patches.mamba2.CHUNK_SIZE; default: the mixer's own; the per-trajectory "
                             "path is transformers' own)")
    args = parser.parse_args()
    from harts_hf.model_patches import mamba2

    # put back at the end (the device worker runs its jobs in one process)
    saved = mamba2.SCAN_INPUTS, mamba2.CHUNK_SIZE
    mamba2.SCAN_INPUTS, mamba2.CHUNK_SIZE = args.mamba_scan, args.mamba_chunk
    try:
        run_stages(args)
    finally:
        mamba2.SCAN_INPUTS, mamba2.CHUNK_SIZE = saved


def run_stages(args) -> None:
    from run_record import write_run_record

    out = Path(args.out)
    write_run_record(out)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    import transformers

    results["transformers"] = transformers.__version__
    results["mamba_scan_inputs"] = args.mamba_scan
    results["mamba_chunk"] = args.mamba_chunk

    def save():
        (out / "gpu_parity.json").write_text(json.dumps(results, indent=2, default=str))
        print("saved", results.get("model_stages"), flush=True)

    model = None
    if args.preset is not None and "model" not in args.skip:
        import bench_tree_vs_trajectory as bench

        model = spread_decays(bench.build_model(args.preset, args.family, torch.device("cuda"), torch.bfloat16))
        results["preset"] = {"model": args.preset, "family": bench.MODELS[args.preset].get("family", args.family)}
    for name, step in (("kernel", kernel_parity),
                       ("model", lambda r: model_parity(r, args.scale, save, model=model, timing=args.timing))):
        if name in args.skip:
            continue
        start = time.perf_counter()
        try:
            step(results)
        except Exception:  # keep going: report what broke and where
            results[f"{name}_error"] = traceback.format_exc()
            print(results[f"{name}_error"])
        results[f"{name}_wall_s"] = time.perf_counter() - start
        (out / "gpu_parity.json").write_text(json.dumps(results, indent=2, default=str))
    print(json.dumps({k: v for k, v in results.items() if not k.endswith("_error")}, indent=2, default=str))


if __name__ == "__main__":
    main()
