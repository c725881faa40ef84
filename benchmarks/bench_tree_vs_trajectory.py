"""Tree execution against per-trajectory execution of the same batch, with the physical limit S_phys.

    python benchmarks/bench_tree_vs_trajectory.py --model qwen3_next_2b --workloads swe tau grpo --scale 0.05 --out results/
    python benchmarks/bench_tree_vs_trajectory.py --model tiny --workloads swe --scale 0.002 --device cpu   # smoke test

Per workload, in one process (warm-up first; the first fla call compiles for ~100 s):
- tree: one forward+backward over the prefix forest (harts_hf.tree_logprobs);
- packed: the strongest per-trajectory path — every trajectory its own tree in ONE packed call (same kernels, no
  padding, no sharing);
- loop: every trajectory alone through the unpatched model (transformers' kernels), one call each;
- padded: TRL-style right-padded micro-batches through the unpatched model with an attention mask.
Per-call overhead ``c``, per-token cost ``a`` and per-pair cost ``b`` are fitted from single-trajectory timings of
several lengths (``t = c + a L + b L^2 / 2``), giving the physical limit of computing every unique token once,
``S_phys = (a sum L + b sum L^2/2) / (a U + b sum depth)`` (replayed tokens and per-call overheads count as
overhead of the tree path, not as physical work; null, with the reason in ``S_phys_undefined``, when the fit gives
a = b = 0, as noisy timings on a loaded CPU can); next to it the stricter fraction with the per-call cost counted as
the strongest baseline pays it (``S_phys_with_calls``: c once for packed, per trajectory for the loop, per
micro-batch for padded; the tree pays it once). The speed-up is measured against the fastest of the measured
per-trajectory paths (packed, loop, padded).
Gradient checkpointing is on. Writes ``<out>/bench_tree_vs_trajectory.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

MODELS = {
    "tiny": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                 intermediate_size=128, vocab_size=1024),
    "qwen3_next_2b": dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=2,
                          head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                          linear_value_head_dim=128, intermediate_size=6144, vocab_size=151936),
}
MODELS["qwen3_next_2b_4layers"] = dict(MODELS["qwen3_next_2b"], num_hidden_layers=4)  # same layer shapes
# Kimi Delta Attention hybrids with multi-head latent attention. Layer shapes from transformers' configuration
# defaults (BailingHybridConfig: inclusionAI/Ling-3.0-Flash's; KimiLinearConfig: Kimi-Linear-48B-A3B's): Ling-3.0-tiny's
# own configuration was not at hand offline. Depth and expert count are cut so one H200 holds fwd+bwd; every layer
# keeps its widths, head counts and dims, the KDA:MLA ratio (5:1 and 3:1) and the MoE layout (8 routed of the
# experts, one shared, the first layers dense).
MODELS["ling3_shaped"] = dict(
    family="bailing_hybrid", hidden_size=2560, num_hidden_layers=12, layer_group_size=6, num_attention_heads=32,
    num_key_value_heads=32, head_dim=128, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
    qk_nope_head_dim=128, v_head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_local_experts=32,
    num_experts_per_tok=8, n_shared_experts=1, n_group=8, topk_group=4, first_k_dense_replace=2, num_mtp_layers=0,
    vocab_size=157184)
# Nemotron-H's layer kinds (Mamba-2, squared-ReLU MLP and a few attention blocks, transformers' NemotronHConfig
# defaults for the mixer shapes: 64-dim heads, state 128, 8 groups, chunks of 128) at hidden 2048 over 24 blocks
_NEMOTRON_BLOCKS = ["linear_attention", "mlp"] * 12
_NEMOTRON_BLOCKS[6] = _NEMOTRON_BLOCKS[18] = "full_attention"
MODELS["nemotron_h_shaped"] = dict(
    family="nemotron_h", hidden_size=2048, layers_block_type=_NEMOTRON_BLOCKS, num_hidden_layers=24,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, intermediate_size=8192, mamba_num_heads=64,
    mamba_head_dim=64, ssm_state_size=128, n_groups=8, conv_kernel=4, chunk_size=128, vocab_size=131072)
MODELS["kimi_linear_dense_shaped"] = dict(  # the dense-FFN Kimi-Linear-shaped preset: MLPs of 9216 in every layer
    family="kimi_linear", hidden_size=2304, num_hidden_layers=12, num_attention_heads=32, num_key_value_heads=32,
    kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
    linear_head_dim=128, linear_num_heads=32, intermediate_size=9216, mlp_layer_types=["dense"] * 12,
    layer_types=["full_attention" if i % 4 == 3 else "linear_attention" for i in range(12)],
    vocab_size=163840)


_FUSED = dict(token_ops="auto", logprob_stats="auto", varlen="torch", norm="harts", shared_casts=False, gdn_public=False,
              graph_tokens=0, experts="cuda", scan="cuda", shared_keys=False, gather_sum="rows", state_pass="auto",
              kda_inputs=True, keep_mixers=False, executed_mixers=False, scan_chunk=64)
KERNEL_SETS = {
    "fused": _FUSED,
    "reference": dict(_FUSED, token_ops="torch", logprob_stats="torch", experts="never"),
    "fused_fp32_experts": dict(_FUSED, experts="never"),
    "fused_fla_norm": dict(_FUSED, norm="fla"),
    "fused_norm": dict(_FUSED, norm="harts"),
    "fused_fa4": dict(_FUSED, varlen="fa4"),
    "fused_fa4_fla_norm": dict(_FUSED, varlen="fa4", norm="fla"),
    "fused_fa4_norm": dict(_FUSED, varlen="fa4", norm="harts"),
    "fused_fa4_shared_casts": dict(_FUSED, varlen="fa4", shared_casts=True),
    "fused_fa4_public_gdn": dict(_FUSED, varlen="fa4", gdn_public=True),
    "fused_fa4_norm_casts": dict(_FUSED, varlen="fa4", norm="harts", shared_casts=True),
    "fused_fa4_all": dict(_FUSED, varlen="fa4", norm="harts", shared_casts=True, gdn_public=True),
    "fused_fa4_graphs": dict(_FUSED, varlen="fa4", graph_tokens=16384),
    "fused_half_scan": dict(_FUSED, scan="half"),
    "fused_fp32_scan": dict(_FUSED, scan="fp32"),
    "fused_shared_keys": dict(_FUSED, shared_keys=True),
    "fused_fa4_shared_keys": dict(_FUSED, varlen="fa4", shared_keys=True),
    "fused_flex": dict(_FUSED, varlen="flex"),
    "fused_row_sum": dict(_FUSED, gather_sum="rows"),
    "fused_index_add": dict(_FUSED, gather_sum="index_add"),
    "fused_rounds_state": dict(_FUSED, state_pass="rounds"),
    "fused_module_kda_inputs": dict(_FUSED, kda_inputs=False),
    "fused_keep_mixers": dict(_FUSED, keep_mixers=True),
    "fused_fa4_keep_mixers": dict(_FUSED, varlen="fa4", keep_mixers=True),
    "fused_fa4_keep_mixers_shared_keys": dict(_FUSED, varlen="fa4", keep_mixers=True, shared_keys=True),
    "fused_executed_mixers": dict(_FUSED, executed_mixers=True),
    "fused_keep_mixers_executed": dict(_FUSED, keep_mixers=True, executed_mixers=True),
    "fused_fa4_keep_mixers_executed": dict(_FUSED, varlen="fa4", keep_mixers=True, executed_mixers=True),
    "fused_keep_mixers_scan64": dict(_FUSED, keep_mixers=True, scan_chunk=64),
    "fused_own_scan_chunks": dict(_FUSED, scan_chunk=None),
    "fused_keep_mixers_own_scan_chunks": dict(_FUSED, keep_mixers=True, scan_chunk=None),
}
"""Kernel sets the benchmarks time, as settings of ``token_ops.ops.BACKEND``, ``logprob_stats.ops.BACKEND``,
``tree_attention.varlen.KERNEL``, ``token_ops.ops.NORM_KERNEL``, ``model_patches.core.SHARED_CASTS``,
``tree_gated_delta_rule.fla_backend.PUBLIC_PER_ROUND``, ``cuda_graphs.MAX_TOKENS``,
``model_patches.token_modules.AUTOCAST_EXPERTS`` and ``model_patches.mamba2.SCAN_INPUTS``. ``fused`` is harts_hf's
default without FlashAttention-4 (torch's flash varlen, named: since 2026-12-07 the default, ``varlen.KERNEL =
"auto"``, takes FlashAttention-4 where it is installed), ``fused_fa4`` the same with the tree attention on
FlashAttention-4. Since 2026-12-02 the default RMSNorm kernel is harts_hf's own
(``token_ops.NORM_KERNEL = "harts"``); ``fused_fla_norm`` / ``fused_fa4_fla_norm`` run fla's, as ``fused`` /
``fused_fa4`` did before (rows measured earlier name the sets as they were: ``fused_norm``, ``fused_fa4_norm`` and
``fused_fa4_norm_casts`` were the ones with harts_hf's kernel, the others had fla's). The other sets change one
thing against ``fused_fa4``: one autocast cast shared by the projections of an activation, fla's public Gated
DeltaNet function per round (FlashQLA where importable); ``fused_fa4_all`` both; ``fused_fa4_graphs`` records the Gated
DeltaNet node's bodies as CUDA graphs on plans of up to 16,384 executed tokens (``cuda_graphs.MAX_TOKENS``; 0, off, in
the other sets). The 2026-12-04 run of tau at scale 0.02 named the same two settings ``fused_fa4`` (graphs on, then the
default) and ``fused_fa4_no_graphs``. ``fused_fp32_experts`` (and ``reference``) run MoE models' routed experts as
transformers does under autocast, in the weights' dtype (fp32 here); every set before 2026-12-05 ran them so.
Mamba-2's scan gets its ``C``, ``B`` and ``dt x`` in the half precision the model runs in on CUDA (as transformers'
CUDA path hands them to ``mamba_ssm``; harts_hf's default since 2026-12-06, ``SCAN_INPUTS = "cuda"``) in every set but
``fused_fp32_scan`` (fp32, as every set before 2026-12-06 ran it; ``fused_half_scan``, the half inputs before they
were the default, now computes as ``fused`` on the GPU). ``fused_shared_keys`` (``fused_fa4_shared_keys``) attends
key segments shared by many runs in place instead of gathering them per run
(``tree_attention.varlen.SHARED_KEYS_IN_PLACE``; the packed path shares none). ``fused_flex`` runs the tree attention
through FlexAttention on the packed rows (``varlen.KERNEL = "flex"``: nothing gathered; the packed path, which gathers
nothing, keeps torch's flash varlen). Every set sums the gradients of the keys and values gathered per run with
harts_hf's Triton kernel (``varlen.GATHER_SUM = "rows"``: no atomics, no fp32 buffer; the default since 2026-12-06,
when ``fused_row_sum`` named it and the other sets ran ``index_add_``) but ``fused_index_add`` (fp32 ``index_add_``, as
every set before then). ``fused_rounds_state`` runs fla's state pass once per round in the Gated DeltaNet and KDA nodes
(``fla_backend.STATE_PASS = "rounds"``) where the others pick per plan (``"auto"``: harts_hf's serial state pass on the
forests timed here); KDA's node ran fla's per round before 2026-12-06's evening, whatever the setting.
``fused_module_kda_inputs`` computes Kimi Delta Attention's q, k, v and forget gate with transformers' modules (every
set before that evening) where the others run q, k and v as one product and the gate's projections with fla's fused gate
kernel (``kimi_delta_attention.FUSED_INPUTS``). ``fused_keep_mixers`` keeps the linear-attention and Mamba-2 nodes'
state pass and output stage from the forward for the checkpointed rerun (``keep_mixer_outputs``, a setting of the
model: applied where :func:`use_kernels` is given it; both paths of the probe run the same model);
``fused_fa4_keep_mixers`` the same on FlashAttention-4, ``fused_fa4_keep_mixers_shared_keys`` with shared key
segments attended in place too. On FlashAttention-4 multi-head latent attention's values run
at their own width (128 beside keys of 192) since 2026-12-07, zero-padded to the keys' width before. The sets ending
``executed_mixers`` / ``_executed`` run every recurrent mixer whole in its node's executed layout (hidden states
gathered in and outputs gathered out once, ``gated_deltanet.EXECUTED_LAYOUT``) where the others gather the node's
inputs and outputs; on the packed path (nothing replayed) the two are the same. Mamba-2's scan runs on chunks of 64
(``mamba2.CHUNK_SIZE``, harts_hf's default since 2026-12-07, on both paths) in every set but those ending
``own_scan_chunks`` (the mixer's own: Nemotron-H's 128, as every set before then ran it); on 2026-12-07
``fused_keep_mixers_scan64`` named the chunks of 64 beside ``fused_keep_mixers`` with the mixer's own (now the same
set)."""


def use_kernels(name: str, model=None) -> None:
    """Put the kernel set ``name`` of :data:`KERNEL_SETS` in force; its model setting (``keep_mixers``) on
    ``model`` where given (a set that turns it on needs the model)."""
    from harts_hf.kernels import cuda_graphs
    from harts_hf.kernels.logprob_stats import ops as logprob_ops
    from harts_hf.kernels.token_ops import ops as token_ops
    from harts_hf.kernels.tree_attention import varlen
    from harts_hf.kernels.tree_gated_delta_rule import fla_backend
    from harts_hf.model_patches import core, gated_deltanet, kimi_delta_attention, mamba2, token_modules

    kernels = KERNEL_SETS[name]
    token_ops.BACKEND, logprob_ops.BACKEND = kernels["token_ops"], kernels["logprob_stats"]
    varlen.KERNEL, token_ops.NORM_KERNEL = kernels["varlen"], kernels["norm"]
    core.SHARED_CASTS, fla_backend.PUBLIC_PER_ROUND = kernels["shared_casts"], kernels["gdn_public"]
    cuda_graphs.MAX_TOKENS = kernels["graph_tokens"]
    token_modules.AUTOCAST_EXPERTS = kernels["experts"]
    mamba2.SCAN_INPUTS = kernels["scan"]
    varlen.SHARED_KEYS_IN_PLACE = kernels["shared_keys"]
    varlen.GATHER_SUM = kernels["gather_sum"]
    fla_backend.STATE_PASS = kernels["state_pass"]
    kimi_delta_attention.FUSED_INPUTS = kernels["kda_inputs"]
    gated_deltanet.EXECUTED_LAYOUT = kernels["executed_mixers"]
    mamba2.CHUNK_SIZE = kernels["scan_chunk"]
    if model is not None:
        from harts_hf.model_patches import keep_mixer_outputs

        keep_mixer_outputs(model, kernels["keep_mixers"])
    elif kernels["keep_mixers"]:
        raise ValueError(f"kernel set {name!r} keeps the mixers' outputs, a setting of the model: pass the model")


def build_model(name: str, family: str, device, dtype):
    """The preset ``name`` of :data:`MODELS` with random weights, gradient checkpointing on, in train mode.
    ``family`` (qwen3_next or qwen3_5) applies to the Qwen-shaped presets; the others carry their own."""
    import transformers

    spec = dict(MODELS[name])
    family = spec.pop("family", family)
    layers = spec["num_hidden_layers"]
    if family in ("qwen3_next", "qwen3_5"):  # the others name their layers' kinds themselves
        spec["layer_types"] = ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * (layers // 4)
    spec["max_position_embeddings"] = 1 << 20
    if family == "qwen3_next":
        config = transformers.Qwen3NextConfig(**spec, mlp_only_layers=list(range(layers)), router_aux_loss_coef=0.0)
        model = transformers.Qwen3NextForCausalLM(config)
    elif family == "qwen3_5":
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**spec))
    elif family == "bailing_hybrid":
        model = transformers.BailingHybridForCausalLM(transformers.BailingHybridConfig(**spec, pad_token_id=0))
    elif family == "nemotron_h":
        model = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**spec))
    elif family == "kimi_linear":
        model = transformers.KimiLinearForCausalLM(transformers.KimiLinearConfig(**spec, pad_token_id=0,
                                                                                 bos_token_id=1, eos_token_id=2))
    else:
        raise ValueError(f"build_model: unknown family {family!r}")
    model = model.to(device=device, dtype=dtype)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def timed(device, function, repeats: int):
    """Mean seconds and peak GiB of ``function`` (called once more first as warm-up)."""
    function()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(repeats):
        function()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / repeats
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return seconds, peak


def run_tree(model, forest, attention_backend: str = "auto", zero_grad: bool = True):
    """One fwd+bwd of ``forest`` (loss: the sum of its log-probs); ``zero_grad=False`` accumulates into the
    gradients already there, as a trainer's later microbatches do."""
    from harts_hf import tree_logprobs

    if zero_grad:
        model.zero_grad(set_to_none=True)
    out = tree_logprobs(model, forest=forest, attention_backend=attention_backend)
    sum(lp.sum() for lp in out.logprobs).backward()
    return out.stats


def run_loop(model, sequences, device):
    model.zero_grad(set_to_none=True)
    for sequence in sequences:
        ids = torch.tensor(sequence, device=device).unsqueeze(0)
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state[0, :-1]
        model.lm_head(hidden).float().log_softmax(-1).gather(-1, ids[0, 1:, None]).sum().backward()


def run_padded(model, sequences, device, micro_batch: int):
    model.zero_grad(set_to_none=True)
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    for start in range(0, len(order), micro_batch):
        rows = [sequences[i] for i in order[start:start + micro_batch]]
        width = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long, device=device)
        mask = torch.zeros_like(ids)
        for j, row in enumerate(rows):
            ids[j, : len(row)] = torch.tensor(row, device=device)
            mask[j, : len(row)] = 1
        hidden = model.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state[:, :-1]
        logprobs = model.lm_head(hidden).float().log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
        (logprobs * mask[:, 1:]).sum().backward()


def fit_costs(model, device, lengths, vocab, repeats):
    """Least-squares c, a, b >= 0 from single-trajectory fwd+bwd times: t(L) = c + a L + b L^2 / 2."""
    rng = np.random.default_rng(0)
    rows, times = [], []
    for length in lengths:
        sequence = rng.integers(0, vocab, length).tolist()
        seconds, _ = timed(device, lambda s=sequence: run_loop(model, [s], device), repeats)
        print(f"  fit: L={length}: {seconds:.3f} s", flush=True)
        rows.append([1.0, length, length * length / 2])
        times.append(seconds)
    from harts_hf.planner import nnls

    c, a, b = nnls(np.array(rows, dtype=float), np.array(times))
    return float(c), float(a), float(b), dict(zip(lengths, times))


def workload_sequences(name: str, scale: float, vocab: int) -> list[list[int]]:
    """The benchmark's trajectories of workload preset ``name`` at ``scale`` (seed 0), token ids folded into
    ``vocab``."""
    from harts_hf.workloads import make_workload

    return [[t % vocab for t in s] for s in make_workload(name, scale=scale, seed=0).sequences]


def bench_workload(model, device, name, scale, c, a, b, repeats, micro_batch, skip=()) -> dict:
    """One workload: tree, packed, loop and padded fwd+bwd times, peak memory, statistics and S_phys."""
    from harts_hf.trees import PrefixForest

    sequences = workload_sequences(name, scale, model.config.vocab_size)
    forest = PrefixForest.from_sequences(sequences)
    separate = PrefixForest.from_sequences(sequences, groups=list(range(len(sequences))))
    row = {}
    seconds, peak = timed(device, lambda f=forest: run_tree(model, f), repeats)
    stats = run_tree(model, forest)
    row["tree"] = {"seconds": seconds, "peak_gib": peak}
    print(f"  {name}@{scale}: tree {seconds:.3f} s, {peak:.1f} GiB, {stats['unique_tokens']} unique tokens", flush=True)
    if "packed" not in skip:
        seconds, peak = timed(device, lambda f=separate: run_tree(model, f), repeats)
        row["packed"] = {"seconds": seconds, "peak_gib": peak}
        print(f"  {name}@{scale}: packed {seconds:.3f} s, {peak:.1f} GiB", flush=True)
    if "loop" not in skip:
        seconds, peak = timed(device, lambda s=sequences: run_loop(model, s, device), repeats)
        row["loop"] = {"seconds": seconds, "peak_gib": peak}
        print(f"  {name}@{scale}: loop {seconds:.3f} s, {peak:.1f} GiB", flush=True)
    if "padded" not in skip:
        seconds, peak = timed(device, lambda s=sequences: run_padded(model, s, device, micro_batch), repeats)
        row["padded"] = {"seconds": seconds, "peak_gib": peak}
        print(f"  {name}@{scale}: padded {seconds:.3f} s, {peak:.1f} GiB", flush=True)
    row["stats"] = stats
    row.update(physical_limits([len(s) for s in sequences], stats, c, a, b, micro_batch))
    add_throughput(row, model, forest.pack().stats())
    return score(row)


def add_throughput(row: dict, model, forest_stats: dict) -> None:
    """Every measured path of ``row`` gets ``throughput`` (:func:`model_flops.throughput`: MFU, HFU, unique and path
    tokens/s): the tree over the unique work, the per-trajectory paths over the path work; and ``flop_ratio``."""
    from model_flops import forest_throughput

    for key in ("tree", *BASELINES):
        if key in row:
            row[key]["throughput"] = forest_throughput(model, row[key]["seconds"], forest_stats, tree=key == "tree")
    row["flop_ratio"] = row["tree"]["throughput"]["flop_ratio"]


def physical_limits(lengths, stats: dict, c: float, a: float, b: float, micro_batch: int) -> dict:
    """S_phys of a forest (``stats``: its ``unique_tokens`` and ``tree_attention_pairs``) over trajectories of
    ``lengths`` at the fitted costs c (s/call), a (s/token), b (s/pair): ``loop_model_seconds`` (the fitted cost of
    the plain loop), ``tree_physical_seconds`` (the unique work at a and b), ``S_phys`` and ``S_phys_with_calls``
    (the per-call cost c counted as each baseline pays it; the tree pays it once). A fit with a = b = 0 (the
    single-trajectory times did not grow with length: too few lengths, or too noisy, as on a loaded CPU) prices no
    work: ``S_phys`` is then None and ``S_phys_undefined`` says why; a limit whose price is 0 is None too."""
    lengths = np.asarray(lengths, dtype=float)
    per_trajectory = float(a * lengths.sum() + b * (lengths ** 2 / 2).sum())
    tree_work = float(a * stats["unique_tokens"] + b * stats["tree_attention_pairs"])
    limits = {"loop_model_seconds": float(c * len(lengths) + per_trajectory), "tree_physical_seconds": tree_work,
              "S_phys": per_trajectory / tree_work if tree_work > 0 else None}
    if limits["S_phys"] is None:
        limits["S_phys_undefined"] = (f"the cost fit prices no per-token or per-pair work (a = {a:.3g}, b = {b:.3g}):"
                                      " the single-trajectory times did not grow with length")
    calls = {"packed": 1, "loop": len(lengths), "padded": -(-len(lengths) // micro_batch)}
    limits["S_phys_with_calls"] = {key: (c * n + per_trajectory) / (c + tree_work) if c + tree_work > 0 else None
                                   for key, n in calls.items()}
    return limits


BASELINES = ("packed", "loop", "padded")  # the per-trajectory paths; the speed-up is against the fastest measured


def score(row: dict) -> dict:
    """Speed-up of the tree against the fastest measured per-trajectory path (its name in ``baseline``), that
    speed-up as a fraction of S_phys, and the tree's rate against the plain model's fitted per-token and per-pair
    costs; the last three are None where the fit leaves the limit undefined (:func:`physical_limits`). Called
    again when a later stage adds a baseline (padded)."""
    measured = {key: row[key]["seconds"] for key in BASELINES if key in row}
    row["baseline"] = min(measured, key=measured.get) if measured else "tree"
    seconds = measured[row["baseline"]] if measured else row["tree"]["seconds"]
    row["speedup_vs_strongest"] = seconds / row["tree"]["seconds"]
    row["fraction_of_S_phys"] = row["speedup_vs_strongest"] / row["S_phys"] if row["S_phys"] else None
    # the stricter fraction: the limit with the per-call cost c that the strongest baseline pays (once for packed)
    with_calls = row.get("S_phys_with_calls", {}).get(row["baseline"])
    row["fraction_of_S_phys_with_calls"] = row["speedup_vs_strongest"] / with_calls if with_calls else None
    # the tree's rate against the plain model's: 1.0 = every unique token at the unpatched model's per-token cost
    work = row["tree_physical_seconds"]
    row["tree_rate_vs_plain"] = work / row["tree"]["seconds"] if work > 0 else None
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3_next_2b", choices=list(MODELS))
    parser.add_argument("--family", default="qwen3_next", choices=["qwen3_next", "qwen3_5"])
    parser.add_argument("--workloads", nargs="+", default=["swe", "tau", "grpo"])
    parser.add_argument("--scale", type=float, default=0.05)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=4, help="rows per padded micro-batch (TRL baseline)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["loop", "padded", "packed"])
    parser.add_argument("--out", default="results")
    args = parser.parse_args()

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(args.model, args.family, device, dtype)
    vocab = model.config.vocab_size
    from run_record import write_run_record

    out = Path(args.out)
    write_run_record(out)
    results = {"model": args.model, "family": args.family, "device": str(device), "scale": args.scale,
               "torch": torch.__version__, "workloads": {}}
    fit_lengths = [256, 1024, 2048, 4096, 8192] if device.type == "cuda" else [64, 128, 256, 512]
    c, a, b, fit_times = fit_costs(model, device, fit_lengths, vocab, args.repeats)
    results["cost_fit"] = {"c_seconds_per_call": c, "a_seconds_per_token": a, "b_seconds_per_pair": b,
                           "times": fit_times}

    for name in args.workloads:
        results["workloads"][name] = bench_workload(model, device, name, args.scale, c, a, b, args.repeats,
                                                    args.micro_batch, args.skip)
        (out / "bench_tree_vs_trajectory.json").write_text(json.dumps(results, indent=2, default=str))
    print_table(results)


def print_table(results: dict) -> None:
    fit = results["cost_fit"]
    print(f"\nmodel {results['model']} ({results['family']}) on {results['device']}, scale {results['scale']}; "
          f"c = {fit['c_seconds_per_call']:.3e} s/call, a = {fit['a_seconds_per_token']:.3e} s/token, "
          f"b = {fit['b_seconds_per_pair']:.3e} s/pair")
    print("| workload | R_tok | R_att | S_phys | tree s | packed s | loop s (fit) | padded s | speed-up (vs fastest per-traj.) | "
          "of S_phys (c counted) | tree rate vs plain | tree GiB | packed GiB | padded GiB | rounds | replay |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, row in results["workloads"].items():
        s = row["stats"]
        get = lambda key, field="seconds", row=row: row.get(key, {}).get(field, float("nan"))  # noqa: E731
        print(f"| {name} | {s['R_tok']:.2f} | {s['R_att']:.2f} | {_ratio(row['S_phys'])} | {get('tree'):.3f} | "
              f"{get('packed'):.3f} | {get('loop'):.3f} ({row['loop_model_seconds']:.1f}) | {get('padded'):.3f} | "
              f"{row['speedup_vs_strongest']:.2f} ({row.get('baseline', '?')}) | {_ratio(row['fraction_of_S_phys'])} "
              f"({_ratio(row.get('fraction_of_S_phys_with_calls'))}) | "
              f"{_ratio(row['tree_rate_vs_plain'])} | {get('tree', 'peak_gib'):.1f} | {get('packed', 'peak_gib'):.1f} | {get('padded', 'peak_gib'):.1f} | "
              f"{s['gdn_rounds']} | {s['gdn_replay_tokens']} |")


def _ratio(value) -> str:
    """A ratio for the table, or "n/a" where the cost fit leaves it undefined (None)."""
    return "n/a" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    main()
