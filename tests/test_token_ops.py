"""Fused per-token modules: which modules the patch recognises (by what they compute), that everything else keeps
transformers' code, that CPU calls run the original forward bit for bit, and the references of the fused ops
against transformers' own modules. The fused kernels themselves run under Triton's interpreter in
scripts/check_fla_nodes_on_cpu.py (check_token_ops) and on the GPU in benchmarks/gpu_kernels.py --ops token."""

import subprocess
import sys
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from harts_hf.kernels.logprob_stats import logprob_entropy, logprob_entropy_reference, logprob_stats_backend
from harts_hf.kernels.token_ops import gated_rms_norm_reference, rms_norm_reference, token_ops_backend
from harts_hf.model_patches import apply_tree_patches
from harts_hf.model_patches.token_modules import token_module_forwards
from tests.models import build

OFFSET, PLAIN, FP32_WEIGHT = (True, True), (False, False), (False, True)  # (offset, fp32_weight) of the norms
QWEN_GATED, KDA_GATED = ("silu", False), ("sigmoid", True)  # (activation, fp32) of the gated norms
EXPECTED = {
    "qwen3_next": {"Qwen3NextRMSNorm": (13, OFFSET), "Qwen3NextMLP": (4, None),
                   "Qwen3NextRMSNormGated": (2, QWEN_GATED)},
    "qwen3_5": {"Qwen3_5RMSNorm": (13, OFFSET), "Qwen3_5MLP": (4, None), "Qwen3_5RMSNormGated": (2, QWEN_GATED)},
    "llama": {"LlamaRMSNorm": (5, PLAIN), "LlamaMLP": (2, None)},
    "qwen3": {"Qwen3RMSNorm": (9, PLAIN), "Qwen3MLP": (2, None)},
    # the squared-ReLU MLPs and the Mamba mixer's grouped gated norm (the gated input normalised per group)
    "nemotron_h": {"NemotronHRMSNorm": (6, FP32_WEIGHT), "NemotronHMLP": (2, None), "NemotronHRMSNormGated": (2, None),
                   "NemotronHExperts": (1, None)},
    "bamba": {"BambaRMSNorm": (7, PLAIN), "BambaMLP": (3, None), "BambaRMSNormGated": (2, None)},
    # Kimi Delta Attention's gated norm: all in fp32, a sigmoid gate
    "kimi_linear": {"KimiLinearRMSNorm": (11, PLAIN), "KimiLinearMLP": (4, None),
                    "KimiLinearRMSNormGated": (2, KDA_GATED), "KimiLinearExperts": (2, None)},
    "bailing_hybrid": {"BailingHybridRMSNorm": (13, PLAIN), "BailingHybridMLP": (4, None),
                       "BailingHybridRMSNormGated": (2, KDA_GATED), "BailingHybridExperts": (2, None)},
    # routed experts (transformers' use_experts_implementation): cast to the autocast dtype under autocast
    "qwen3_moe": {"Qwen3MoeRMSNorm": (9, PLAIN), "Qwen3MoeExperts": (2, None)},
    "qwen3_next_moe": {"Qwen3NextRMSNorm": (13, OFFSET), "Qwen3NextMLP": (4, None),
                       "Qwen3NextRMSNormGated": (2, QWEN_GATED), "Qwen3NextExperts": (4, None)},
}


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_recognised_modules(family):
    """Every RMSNorm (offset weight for Qwen3-Next / Qwen3.5, plain for Llama / Qwen3, the weight applied in fp32
    for Nemotron-H), gated norm, SwiGLU MLP and squared-ReLU MLP is found, each with the variant its own forward
    computes."""
    model = build(family)
    found = list(token_module_forwards(model))
    assert Counter(type(m).__name__ for m, _ in found) == {name: n for name, (n, _) in EXPECTED[family].items()}
    for module, attributes in found:
        variant = EXPECTED[family][type(module).__name__][1]
        if variant is not None:
            assert attributes["forward"].handler.args == variant


class CenteredRMSNorm(torch.nn.Module):  # named like an RMSNorm, computes a LayerNorm
    def __init__(self, dim):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        return self.weight * F.layer_norm(x, x.shape[-1:], eps=self.variance_epsilon)


class GeluMLP(torch.nn.Module):  # the SwiGLU layout with another activation
    def __init__(self, dim):
        super().__init__()
        self.gate_proj, self.up_proj = torch.nn.Linear(dim, 8), torch.nn.Linear(dim, 8)
        self.down_proj, self.act_fn = torch.nn.Linear(8, dim), torch.nn.GELU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class ScaledMLP(GeluMLP):  # SiLU, but the forward computes something else
    def __init__(self, dim):
        super().__init__(dim)
        self.act_fn = torch.nn.SiLU()

    def forward(self, x):
        return 2 * super().forward(x)


class ReluMLP(torch.nn.Module):  # the squared-ReLU layout with a plain ReLU
    def __init__(self, dim, act_fn=None):
        super().__init__()
        self.up_proj, self.down_proj = torch.nn.Linear(dim, 8), torch.nn.Linear(8, dim)
        self.act_fn = act_fn or torch.nn.ReLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.up_proj(x)))


class GatedReluSquaredMLP(ReluMLP):  # relu(x) ** 2, but gated: not the squared-ReLU MLP
    def __init__(self, dim):
        from transformers.activations import ReLUSquaredActivation

        super().__init__(dim, ReLUSquaredActivation())
        self.gate_proj = torch.nn.Linear(dim, 8)

    def forward(self, x):
        return self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))


def test_modules_computing_something_else_keep_their_code():
    model = torch.nn.Sequential(CenteredRMSNorm(16), GeluMLP(16), ScaledMLP(16), ReluMLP(16), GatedReluSquaredMLP(16))
    assert list(token_module_forwards(model)) == []


def test_cpu_calls_run_the_original_forward_and_revert_restores_it():
    model = build("qwen3_next")
    x = torch.randn(1, 5, 32)
    norm, mlp = model.model.layers[0].input_layernorm, model.model.layers[0].mlp
    expected = norm(x), mlp(x)
    handle = apply_tree_patches(model)
    assert "forward" in vars(norm) and "forward" in vars(mlp)
    assert torch.equal(norm(x), expected[0]) and torch.equal(mlp(x), expected[1])
    handle.revert()
    assert "forward" not in vars(norm) and "forward" not in vars(mlp)


@pytest.mark.parametrize("family,norm_path,variant", [("qwen3_next", "input_layernorm", OFFSET),
                                                       ("llama", "input_layernorm", PLAIN),
                                                       ("nemotron_h", "norm", FP32_WEIGHT)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_references_are_transformers_formulas(family, norm_path, variant, dtype):
    """The references the probe matches reproduce transformers' modules bit for bit, dtype included."""
    norm = getattr(build(family).model.layers[0], norm_path)
    with torch.no_grad():
        norm.weight.normal_()
        x = torch.randn(7, 32).to(dtype)
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
        got = rms_norm_reference(x, norm.weight, eps, offset=variant[0], fp32_weight=variant[1])
        expected = norm(x)
    assert got.dtype == expected.dtype and torch.equal(got, expected)


@pytest.mark.parametrize("family", ["nemotron_h", "bamba", "granitemoehybrid"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_group_gated_norm_reference_is_transformers_formula(family, dtype):
    """Mamba-2's grouped gated norm: the reference reproduces each family's module bit for bit, dtype included, and
    the patched module's CPU calls run transformers' forward (Falcon-H1's, which rounds elsewhere, is not fused)."""
    from harts_hf.kernels.token_ops import group_gated_rms_norm, group_gated_rms_norm_reference

    model = build(family)
    norm = next(m for m in model.modules() if type(m).__name__.endswith("RMSNormGated"))
    with torch.no_grad():
        norm.weight.normal_()
        x, gate = (torch.randn(1, 7, norm.weight.shape[0]).to(dtype) for _ in range(2))
        expected = norm(x, gate)
        for got in (group_gated_rms_norm_reference(x, gate, norm.weight, norm.variance_epsilon, norm.group_size),
                    group_gated_rms_norm(x, gate, norm.weight, norm.variance_epsilon, norm.group_size)):
            assert got.dtype == expected.dtype and torch.equal(got, expected)
        handle = apply_tree_patches(model)
        try:
            assert "forward" in vars(norm) and torch.equal(norm(x, gate), expected)
        finally:
            handle.revert()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_relu_squared_reference_and_mlp_are_transformers(dtype):
    """The squared ReLU's reference is transformers' activation bit for bit, and the patched Nemotron-H MLP on the
    CPU runs transformers' forward (the kernels run under Triton's interpreter in scripts/check_fla_nodes_on_cpu.py)."""
    from harts_hf.kernels.token_ops import relu_squared, relu_squared_reference

    model = build("nemotron_h")
    mlp = next(m for m in model.modules() if type(m).__name__ == "NemotronHMLP")
    x = torch.randn(5, 32).to(dtype)
    assert torch.equal(relu_squared_reference(x), mlp.act_fn(x))
    assert torch.equal(relu_squared(x), mlp.act_fn(x))  # CPU: the reference
    x = torch.randn(1, 5, 32)
    expected = mlp(x)
    handle = apply_tree_patches(model)
    try:
        assert "forward" in vars(mlp) and torch.equal(mlp(x), expected)
    finally:
        handle.revert()


@pytest.mark.parametrize("family,variant", [("qwen3_next", QWEN_GATED), ("kimi_linear", KDA_GATED),
                                            ("bailing_hybrid", KDA_GATED)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_norm_reference_is_transformers_formula(family, variant, dtype):
    """Each gated-norm reference the probe matches reproduces its family's module bit for bit, dtype included."""
    norm = next(m for m in build(family).modules() if type(m).__name__.endswith("RMSNormGated"))
    with torch.no_grad():
        norm.weight.normal_()
        x, gate = torch.randn(7, norm.weight.shape[0]).to(dtype), torch.randn(7, norm.weight.shape[0]).to(dtype)
        got = gated_rms_norm_reference(x, gate, norm.weight, norm.variance_epsilon, activation=variant[0],
                                       fp32=variant[1])
        expected = norm(x, gate)
    assert got.dtype == expected.dtype and torch.equal(got, expected)


@pytest.mark.parametrize("family,safe", [("kimi_linear", None), ("bailing_hybrid", True), ("bailing_hybrid", False)])
def test_kda_gate_reference_is_transformers_formula(family, safe, monkeypatch):
    """The forget gate's reference (what fla's fused gate computes on CUDA) equals each family's gate module to fp32
    rounding, dtype included, with every gradient; on the CPU the patched mixer calls the module itself, and on the
    fused path a hook on the gate sends the call back to the module."""
    from harts_hf.kernels.token_ops import kda_gate_reference, ops
    from harts_hf.model_patches import kimi_delta_attention

    gate = next(m for m in build(family).modules() if type(m).__name__ in kimi_delta_attention._FORGET_GATES)
    if safe is not None:
        gate.safe_gate = safe
    with torch.no_grad():
        gate.A_log.normal_(0, 0.5)
        gate.dt_bias.normal_()
    kimi = hasattr(gate, "f_a_proj")
    x = torch.randn(1, 9, (gate.f_a_proj if kimi else gate.f_proj).in_features, requires_grad=True)
    f = gate.f_b_proj(gate.f_a_proj(x)) if kimi else gate.f_proj(x)
    got = kda_gate_reference(f.view(1, 9, gate.num_heads, gate.head_dim), gate.A_log, gate.dt_bias,
                             lower_bound=gate.lower_bound if not kimi and gate.safe_gate else None,
                             out_dtype=torch.float32 if kimi else x.dtype)
    expected = gate(x)
    assert got.dtype == expected.dtype
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    params = [x, *gate.parameters()]
    for a, b in zip(torch.autograd.grad(got.sum(), params), torch.autograd.grad(expected.sum(), params)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    calls, module_result = [], object()
    monkeypatch.setattr(gate, "forward", lambda *args: calls.append(args) or [module_result])
    assert kimi_delta_attention._forget_gate(gate, x) is module_result and len(calls) == 1  # the CPU: the module
    monkeypatch.setattr(ops, "BACKEND", "fla")
    monkeypatch.setattr(kimi_delta_attention, "kda_gate", lambda *args, **kw: "fused")
    assert kimi_delta_attention._forget_gate(gate, x) == "fused" and len(calls) == 1
    gate.register_forward_hook(lambda *args: None)
    assert kimi_delta_attention._forget_gate(gate, x) is module_result and len(calls) == 2


@pytest.mark.parametrize("family", ["kimi_linear", "bailing_hybrid"])
def test_kda_qkv_as_one_product(family, monkeypatch):
    """On the fused path q, k and v are one product with the three weights stacked: the three projections' outputs
    side by side (fp32 rounding), the same weight and input gradients; a hooked projection, or the CPU's default,
    keeps the three modules."""
    from harts_hf.kernels.token_ops import ops
    from harts_hf.model_patches import kimi_delta_attention

    mixer = next(m for m in build(family).modules() if hasattr(m, "forget_gate"))
    x = torch.randn(1, 11, mixer.q_proj.in_features, requires_grad=True)
    params = [x, mixer.q_proj.weight, mixer.k_proj.weight, mixer.v_proj.weight]
    expected = kimi_delta_attention._qkv(mixer, x)  # the CPU: the three modules
    assert torch.equal(expected, torch.cat([mixer.q_proj(x), mixer.k_proj(x), mixer.v_proj(x)], -1)[0])
    monkeypatch.setattr(ops, "BACKEND", "fla")
    got = kimi_delta_attention._qkv(mixer, x)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    w = torch.randn(got.shape)
    for a, b in zip(torch.autograd.grad((got * w).sum(), params), torch.autograd.grad((expected * w).sum(), params)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    mixer.k_proj.register_forward_hook(lambda module, args, out: out * 2)
    q, k = mixer.q_proj.out_features, mixer.k_proj.out_features
    hooked = kimi_delta_attention._qkv(mixer, x)
    assert torch.equal(hooked[:, q:q + k], 2 * F.linear(x, mixer.k_proj.weight)[0])


def test_norm_kernel_setting_is_checked():
    """token_ops.NORM_KERNEL picks the fused RMSNorm kernel; an unknown value raises naming both choices (the
    kernels themselves run under Triton's interpreter in scripts/check_fla_nodes_on_cpu.py)."""
    from harts_hf.kernels.token_ops import ops

    assert ops.NORM_KERNEL == "harts"
    x, weight = torch.randn(3, 8), torch.randn(8)
    ops.NORM_KERNEL = "liger"
    try:
        with pytest.raises(ValueError, match="NORM_KERNEL must be 'fla' or 'harts', got 'liger'"):
            ops.rms_norm(x, weight, 1e-6, offset=True, backend="fla")
    finally:
        ops.NORM_KERNEL = "harts"
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-6, offset=True), rms_norm_reference(x, weight, 1e-6, offset=True))


def test_logprob_entropy_reference_and_backends():
    logits, labels = torch.randn(6, 50), torch.randint(0, 50, (6,))
    picked, entropy = logprob_entropy(logits, labels, 0.7)
    log_probs = torch.log_softmax(logits / 0.7, -1)
    assert torch.allclose(picked, log_probs[torch.arange(6), labels])
    assert torch.allclose(entropy, -(log_probs.exp() * log_probs).sum(-1))
    assert logprob_stats_backend(logits) == "torch" and token_ops_backend(logits) == "torch"
    assert torch.equal(logprob_entropy_reference(logits, labels, 0.7)[0], picked)
    with pytest.raises(ValueError, match="backend must be 'auto', 'torch' or 'triton', got 'cuda'"):
        logprob_entropy(logits, labels, backend="cuda")
    with pytest.raises(ValueError, match="backend must be 'auto', 'torch' or 'fla', got 'x'"):
        token_ops_backend(logits, "x")
    with pytest.raises(ValueError, match=r"logits must be \[N, V\] and labels \[N\]"):
        logprob_entropy(logits, labels[:3])


def test_varlen_kernel_choice():
    from harts_hf.kernels.tree_attention import varlen

    with pytest.raises(ValueError, match="varlen KERNEL must be 'auto', 'torch', 'fa4' or 'flex', got 'fa3'"):
        varlen.varlen_kernel(torch.device("cpu"), "fa3")
    assert varlen.varlen_kernel(torch.device("cpu"), "torch") == "torch"
    # the default, read in a fresh process (benchmark runs in this one set it): FlashAttention-4 where it is installed
    # (auto), torch's flash varlen elsewhere
    code = "from harts_hf.kernels.tree_attention import varlen; print(varlen.KERNEL)"
    fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert fresh.stdout.strip() == "auto"


def test_varlen_auto_takes_fa4_only_with_the_functions_harts_hf_calls(monkeypatch):
    """'auto' picks FlashAttention-4 on a Hopper-class GPU where it imports and has the functions the dispatcher
    ops call; an installed version without them falls back to torch's kernel instead of failing mid-step. (No GPU
    here: the capability and the import are stood in for.)"""
    from harts_hf.kernels.tree_attention import fa4, varlen

    monkeypatch.setattr(varlen, "_fa4_importable", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(fa4, "check_interface", lambda: None)
    assert varlen.varlen_kernel(torch.device("cpu"), "auto") == "fa4"

    def missing():
        raise ImportError("flash_attn.cute.interface._flash_attn_bwd lacks learnable_sink")

    monkeypatch.setattr(fa4, "check_interface", missing)
    assert varlen.varlen_kernel(torch.device("cpu"), "auto") == "torch"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(fa4, "check_interface", lambda: None)
    assert varlen.varlen_kernel(torch.device("cpu"), "auto") == "torch"


@pytest.mark.parametrize("rows,blocks", [(1, [2048]), (2048, [2048]), (2049, [2048, 2048]),
                                         (97_199, [65536, 16384, 8192, 4096, 2048, 2048]),
                                         (200_000, [65536, 65536, 65536, 2048, 2048])])
def test_norm_rows_reach_fla_in_power_of_two_blocks(rows, blocks):
    """fla's RMSNorm kernels compile per row count: the rows reach them in blocks of 2048 x 2**j (the last one
    zero-padded), and the blocks change neither the result nor the gradient."""
    from harts_hf.kernels.token_ops.ops import _power_of_two_blocks

    seen = []

    def row_wise(x):
        seen.append(x.shape[0])
        return x * torch.arange(x.shape[1], dtype=x.dtype)

    x = torch.randn(rows, 3, requires_grad=True)
    y = _power_of_two_blocks(row_wise, x)
    (y.square().sum()).backward()
    assert seen == blocks and torch.equal(y, x * torch.arange(3.0))
    assert torch.equal(x.grad, 2 * x.detach() * torch.arange(3.0) ** 2)


def _run_scores(qr, kr, scale, window_left, softcap=0.0):
    """Masked scores ``[heads, queries, keys]`` of one run (bottom-right causal, a key at most ``window_left`` rows
    before the diagonal, any when negative; ``c * tanh(s / c)`` first with ``softcap`` c) and the softcap's
    derivative; kr already repeated to the query heads."""
    scores = torch.einsum("qhd,khd->hqk", qr, kr) * scale
    slope = torch.ones_like(scores)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
        slope = 1 - (scores / softcap) ** 2
    diagonal = torch.arange(len(qr))[:, None] + len(kr) - len(qr)
    keys = torch.arange(len(kr))[None]
    visible = (keys <= diagonal) & ((window_left < 0) | (keys >= diagonal - window_left))
    return scores.masked_fill(~visible, float("-inf")), slope


def _bottom_right_attention(q, k, v, cu_q, cu_k, scale, window_left, softcap=0.0, sinks=None):
    """Per-run attention (see :func:`_run_scores`) with ``sinks`` (``[HQ]``: one more logit per head, value zero),
    output and FlashAttention-4's varlen log-sum-exp layout ``[heads, tokens]`` (the sink counted)."""
    outs, lses = [], []
    for r in range(len(cu_q) - 1):
        qr, kr, vr = q[cu_q[r]: cu_q[r + 1]], k[cu_k[r]: cu_k[r + 1]], v[cu_k[r]: cu_k[r + 1]]
        group = q.shape[1] // k.shape[1]
        scores, _ = _run_scores(qr, kr.repeat_interleave(group, 1), scale, window_left, softcap)
        logits = scores if sinks is None else torch.cat([scores, sinks[:, None, None].expand(-1, len(qr), 1)], -1)
        lse = logits.logsumexp(-1)
        lses.append(lse)
        outs.append(torch.einsum("hqk,khd->qhd", (scores - lse[..., None]).exp(), vr.repeat_interleave(group, 1)))
    return torch.cat(outs), torch.cat(lses, 1)


def _stand_in_fa4(calls):
    """FlashAttention-4's forward / backward functions, computed by :func:`_bottom_right_attention` (the real
    kernels need a Hopper or Blackwell GPU); ``calls`` counts forwards."""

    def window(left):
        return -1 if left is None else left

    def forward(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, softcap,
                window_size_left, window_size_right, learnable_sink, return_lse):
        assert causal and return_lse and (window_size_right is None) == (window_size_left is None)
        assert softcap is None or softcap > 0  # FlashAttention-4's forward spells "no softcap" None
        calls.append("forward")
        out, lse = _bottom_right_attention(q, k, v, cu_seqlens_q.tolist(), cu_seqlens_k.tolist(), softmax_scale,
                                           window(window_size_left), softcap or 0.0, learnable_sink)
        return out, lse, None, None, None

    def backward(q, k, v, out, dout, lse, *, softmax_scale, causal, softcap, window_size_left, window_size_right,
                 cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, learnable_sink):
        # by hand: the real op's body runs below autograd
        cu_q, cu_k, group = cu_seqlens_q.tolist(), cu_seqlens_k.tolist(), q.shape[1] // k.shape[1]
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        dsink = None if learnable_sink is None else torch.zeros_like(learnable_sink)
        for r in range(len(cu_q) - 1):
            rq, rk = slice(cu_q[r], cu_q[r + 1]), slice(cu_k[r], cu_k[r + 1])
            kr, vr = k[rk].repeat_interleave(group, 1), v[rk].repeat_interleave(group, 1)
            scores, slope = _run_scores(q[rq], kr, softmax_scale, window(window_size_left), softcap)
            p = (scores - lse[:, rq, None]).exp()
            dp = torch.einsum("qhd,khd->hqk", dout[rq], vr)
            row = (dout[rq] * out[rq]).sum(-1).T[..., None]  # [heads, queries, 1]
            ds = p * (dp - row) * slope * softmax_scale
            dq[rq] = torch.einsum("hqk,khd->qhd", ds, kr)
            dk[rk] = torch.einsum("hqk,qhd->khd", ds, q[rq]).unflatten(1, (-1, group)).sum(2)
            dv[rk] = torch.einsum("hqk,qhd->khd", p, dout[rq]).unflatten(1, (-1, group)).sum(2)
            if dsink is not None:
                dsink -= ((learnable_sink[:, None] - lse[:, rq]).exp() * row[..., 0]).sum(1)
        return (dq, dk, dv) if dsink is None else (dq, dk, dv, dsink)

    return forward, backward


@pytest.mark.parametrize("window,softcap,sinks", [(None, None, False), (3, None, False), (None, 2.0, False),
                                                  (None, None, True), (3, 2.0, True)])
def test_fa4_dispatcher_op_gradients_and_kept_under_checkpointing(monkeypatch, window, softcap, sinks):
    """harts::fa4_varlen_fwd / _bwd hand FlashAttention-4's functions the right arguments (window, softcap, sinks)
    and gradients (the sinks' included), and the keep-attention checkpointing policy keeps the forward op's output:
    the backward's rerun does not call it again (without the policy it does). FlashAttention-4 itself is stood in
    for by per-run attention in fp64."""
    from torch.utils.checkpoint import checkpoint

    from harts_hf.kernels.tree_attention import fa4
    from harts_hf.model_patches.checkpointing import _attention_contexts

    calls = []
    monkeypatch.setattr(fa4, "check_interface", lambda: _stand_in_fa4(calls))
    torch.manual_seed(0)
    cu_q, cu_k = torch.tensor([0, 3, 8], dtype=torch.int32), torch.tensor([0, 6, 13], dtype=torch.int32)
    q, k, v = (torch.randn(n, h, 8, dtype=torch.float64, requires_grad=True) for n, h in ((8, 4), (13, 2), (13, 2)))
    sink = torch.randn(4, dtype=torch.float64, requires_grad=True) if sinks else None
    inputs = (q, k, v) + ((sink,) if sinks else ())
    weight = torch.randn(8, 4, 8, dtype=torch.float64)
    out = fa4.fa4_varlen(q, k, v, cu_q, cu_k, 5, 7, None, window, softcap, sink)
    grads = torch.autograd.grad((out * weight).sum(), inputs)
    leaves = [t.detach().requires_grad_() for t in inputs]
    expected, _ = _bottom_right_attention(*leaves[:3], [0, 3, 8], [0, 6, 13], 8 ** -0.5,
                                          -1 if window is None else window - 1, softcap or 0.0,
                                          leaves[3] if sinks else None)
    assert torch.allclose(out, expected, atol=1e-12)
    for got, want in zip(grads, torch.autograd.grad((expected * weight).sum(), leaves), strict=True):
        assert torch.allclose(got, want, atol=1e-12)

    def layer(q, k, v):
        return fa4.fa4_varlen(q * 1.0, k, v, cu_q, cu_k, 5, 7, None, window, softcap, sink).sin()

    for contexts, forwards in ((_attention_contexts, 1), (None, 2)):
        calls.clear()
        keyword = {} if contexts is None else {"context_fn": contexts}
        again = checkpoint(layer, q, k, v, use_reentrant=False, **keyword)
        torch.autograd.grad((again * weight).sum(), inputs)
        assert calls.count("forward") == forwards
        assert torch.allclose(again, expected.sin(), atol=1e-12)


def test_autocast_copies_cast_once_with_the_same_products_and_gradients():
    """With model_patches.core.SHARED_CASTS (off by default), the projections of one activation share one autocast
    cast (autocast_copies): the same products bit for bit, the same weight gradients, the input's gradient summed in
    fp32 as autocast's own casts sum it; without autocast the input itself."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from harts_hf.model_patches import core
    from harts_hf.model_patches.core import autocast_copies

    generator = torch.Generator().manual_seed(0)
    leaf = torch.randn(37, 16, generator=generator).requires_grad_()
    weights = [torch.randn(n, 16, generator=generator).requires_grad_() for n in (8, 5, 3)]
    upstream = [torch.randn(37, n, generator=generator) for n in (8, 5, 3)]

    class CastsOfX(TorchDispatchMode):
        casts = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default and args[0].shape == leaf.shape:
                CastsOfX.casts += 1
            return func(*args, **(kwargs or {}))

    def run(shared: bool):
        CastsOfX.casts = 0
        x = leaf * 1.0  # an activation: autocast caches casts of leaves (weights) only
        with torch.autocast("cpu", dtype=torch.bfloat16), CastsOfX():
            inputs = autocast_copies(x, 3) if shared else [x] * 3
            outputs = [F.linear(a, w) for a, w in zip(inputs, weights)]
        forward_casts = CastsOfX.casts
        loss = sum((out.float() * g).sum() for out, g in zip(outputs, upstream))
        return [out.detach() for out in outputs], torch.autograd.grad(loss, [leaf, *weights]), forward_casts

    plain_outputs, plain_grads, plain_casts = run(False)
    assert run(True)[2] == 3  # off by default: autocast's own cast per product
    core.SHARED_CASTS = True
    try:
        outputs, grads, casts = run(True)
    finally:
        core.SHARED_CASTS = False
    assert (plain_casts, casts) == (3, 1)
    for a, b in zip(outputs, plain_outputs):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)
    assert grads[0].dtype == torch.float32
    torch.testing.assert_close(grads[0], plain_grads[0], rtol=1e-6, atol=1e-6)
    for a, b in zip(grads[1:], plain_grads[1:]):
        assert torch.equal(a, b)
    assert all(copy is leaf for copy in autocast_copies(leaf, 3))  # no autocast: nothing to cast


MOE_FAMILIES = ("qwen3_moe", "qwen3_next_moe", "glm4_moe", "bailing_hybrid")


def _experts(model):
    return [m for m in model.modules() if type(m).__name__.endswith("Experts")]


class _GroupedProducts(TorchDispatchMode):
    """Within it, the (input, weight) dtypes of every grouped matrix product the kernels receive (``aten::_grouped_mm``,
    forward and backward), in ``self.seen``."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten._grouped_mm:
            self.seen.append((args[0].dtype, args[1].dtype))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_routed_experts_run_in_the_autocast_dtype(family, monkeypatch):
    """transformers' grouped_mm experts cast their input to the weights' dtype, so with fp32 weights under bf16
    autocast they ran in fp32. Patched (AUTOCAST_EXPERTS = "always", so that this CPU runs it), every routed expert
    runs in bf16 under autocast: outputs and fp32 weight gradients equal to the same experts called with their weights
    cast to bf16 beforehand, bit for bit; without autocast the original forward, bit for bit."""
    from harts_hf.model_patches import token_modules

    model = build(family)
    assert model.config._experts_implementation == "grouped_mm"
    reference = build(family)
    apply_tree_patches(model)
    monkeypatch.setattr(token_modules, "AUTOCAST_EXPERTS", "always")
    experts, reference_experts = _experts(model), _experts(reference)
    assert experts and all(type(e.forward).__name__ == "PatchedForward" for e in experts)
    for patched, plain in zip(experts, reference_experts):
        hidden = torch.randn(7, model.config.hidden_size, requires_grad=True)
        top_k = plain.config.num_experts_per_tok
        index = torch.stack([torch.randperm(patched.num_experts)[:top_k] for _ in range(7)])
        weights = torch.rand(7, top_k)
        with _GroupedProducts() as products, torch.autocast("cpu", dtype=torch.bfloat16):
            out = patched(hidden, index, weights)
        assert products.seen == [(torch.bfloat16, torch.bfloat16)] * 2  # up and down projections
        grads = torch.autograd.grad(out.float().square().sum(), [hidden, *patched.parameters(recurse=False)])
        cast = {name: p.to(torch.bfloat16) for name, p in plain.named_parameters(recurse=False)}
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = torch.func.functional_call(plain, cast, (hidden, index, weights))
        expected_grads = torch.autograd.grad(expected.float().square().sum(),
                                             [hidden, *plain.parameters(recurse=False)])
        assert torch.equal(out, expected)
        for got, want in zip(grads, expected_grads):
            assert got.dtype == want.dtype and torch.equal(got, want)
        with _GroupedProducts() as products, torch.no_grad():  # no autocast: transformers' forward, in fp32
            assert torch.equal(patched(hidden, index, weights), plain(hidden, index, weights))
        assert products.seen == [(torch.float32, torch.float32)] * 4


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_lora_on_routed_experts(family, monkeypatch):
    """PEFT LoRA on the routed experts' parameters (``LoraConfig(target_parameters=...)``, TRL's recipe for gpt-oss)
    adds its update to the weights inside the experts' call, where they are no longer the module's own parameters:
    the tree is exact in fp32 (log-probs, entropies and every adapter gradient against the per-sequence path), and
    under bf16 autocast the grouped products still take bf16 operands (they took fp32 ones while the cast was made on
    the module's parameters), the adapters getting gradients."""
    from peft import LoraConfig, get_peft_model

    from harts_hf import tree_logprobs
    from harts_hf.model_patches import token_modules
    from tests.forests import chunk_edge_sequences
    from tests.models import VOCAB
    from tests.test_tree_logprobs import compare

    config = LoraConfig(r=4, lora_alpha=8, target_modules=[],
                        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    model = get_peft_model(build(family), config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # PEFT starts every B at zero, which would leave the update out of the check
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(0.05 * torch.randn(parameter.shape, generator=generator))
    sequences = chunk_edge_sequences(vocab=VOCAB)
    compare(model, sequences, grad_tol=1e-4)
    monkeypatch.setattr(token_modules, "AUTOCAST_EXPERTS", "always")
    with _GroupedProducts() as products, torch.autocast("cpu", dtype=torch.bfloat16):
        out = tree_logprobs(model, sequences)
    assert products.seen and set(products.seen) == {(torch.bfloat16, torch.bfloat16)}
    sum(logprobs.sum() for logprobs in out.logprobs).backward()
    adapters = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    assert adapters and all("lora_" in name for name, _ in adapters)
    for name, parameter in adapters:
        assert parameter.grad is not None and torch.isfinite(parameter.grad).all() and parameter.grad.any(), name


def test_routed_experts_cast_is_the_same_under_checkpointing(monkeypatch):
    """The recomputed forward of a checkpointed layer casts as the first forward did (autocast's state travels with
    the checkpoint, and the torch-function mode is entered again): gradients bit for bit those without checkpointing."""
    from harts_hf import tree_logprobs
    from harts_hf.model_patches import token_modules
    from tests.forests import chunk_edge_sequences
    from tests.models import VOCAB

    monkeypatch.setattr(token_modules, "AUTOCAST_EXPERTS", "always")
    sequences = chunk_edge_sequences(vocab=VOCAB)
    grads = []
    for checkpointing in (False, True):
        model = build("qwen3_moe")
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        with _GroupedProducts() as products, torch.autocast("cpu", dtype=torch.bfloat16):
            out = tree_logprobs(model, sequences)
            sum(logprobs.float().sum() for logprobs in out.logprobs).backward()
        assert {weight for _, weight in products.seen} == {torch.bfloat16}  # the recomputation's products too
        grads.append({name: p.grad for name, p in model.named_parameters()})
    assert all(torch.equal(grads[0][name], grads[1][name]) for name in grads[0])


@pytest.mark.parametrize("setting, implementation, cast", [
    ("cuda", "grouped_mm", False),  # the default: CPU inputs keep transformers' code
    ("never", "grouped_mm", False),
    ("always", "eager", False),  # eager / batched_mm run autocast-enabled ops already
    ("always", "grouped_mm", True),
])
def test_routed_experts_cast_only_where_asked(setting, implementation, cast, monkeypatch):
    from harts_hf.model_patches import token_modules

    model = build("qwen3_moe")
    apply_tree_patches(model)
    model.config._experts_implementation = implementation
    monkeypatch.setattr(token_modules, "AUTOCAST_EXPERTS", setting)
    with _GroupedProducts() as products, torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=torch.randint(0, 97, (1, 12)))
    if implementation == "eager":  # F.linear per expert under autocast: bf16 already, nothing for harts_hf to do
        assert not products.seen
    else:
        assert {weight for _, weight in products.seen} == {torch.bfloat16 if cast else torch.float32}


def test_routed_experts_setting_is_checked(monkeypatch):
    from harts_hf.model_patches import token_modules

    model = build("qwen3_moe")
    apply_tree_patches(model)
    monkeypatch.setattr(token_modules, "AUTOCAST_EXPERTS", "bf16")
    with pytest.raises(ValueError, match="AUTOCAST_EXPERTS must be one of"):
        model(input_ids=torch.randint(0, 97, (1, 12)))
