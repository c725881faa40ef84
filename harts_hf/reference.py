"""The obviously-right baseline: run the model on every sequence alone and read off its log-probs.

``torch_reference_kernels()`` makes transformers' Qwen3-Next / Qwen3.5 / Kimi Linear / OLMo Hybrid / Ling 3 and
Mamba-2 hybrid layers use their pure-PyTorch kernels even when fla / causal-conv1d / mamba-ssm (and triton) are
importable, so CPU references never reach Triton.
"""

from __future__ import annotations

import contextlib
import importlib

import torch

__all__ = ["per_sequence_logprobs", "torch_reference_kernels"]

_KERNEL_MODULES = (
    "transformers.models.qwen3_next.modeling_qwen3_next",
    "transformers.models.qwen3_5.modeling_qwen3_5",
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
    "transformers.models.kimi_linear.modeling_kimi_linear",
    "transformers.models.olmo_hybrid.modeling_olmo_hybrid",
    "transformers.models.bailing_hybrid.modeling_bailing_hybrid",
    "transformers.models.nemotron_h.modeling_nemotron_h",
    "transformers.models.bamba.modeling_bamba",
    "transformers.models.granitemoehybrid.modeling_granitemoehybrid",
    "transformers.models.falcon_h1.modeling_falcon_h1",
)
_CHUNKED_RECURRENCES = ("torch_chunk_gated_delta_rule", "chunk_kimi_delta_attention")  # fp32 inside transformers
_MAMBA2_SCANS = ("mamba2_chunk_scan",)  # Mamba-2's chunked scan, fp32 inside transformers


def _mamba2_scan_in_input_dtype(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None,
                                dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False, z=None,
                                **kwargs):
    """transformers' ``mamba2_chunk_scan`` contract (``hidden_states [b, t, h, p]``, ``dt [b, t, h]`` before its
    bias and softplus, ``A [h]``, ``B``, ``C [b, t, g, n]``), computed in the input dtype token by token:
    ``S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T``, ``y_t = S_t C_t + D x_t``."""
    if initial_states is not None or return_final_states or z is not None:
        raise ValueError("the fp64 reference scan runs whole sequences from a zero state, without a gate, only")
    dtype = hidden_states.dtype
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    dt = torch.nn.functional.softplus(dt) if dt_softplus else dt
    dt = dt.clamp(*dt_limit).to(dtype)
    heads = hidden_states.shape[2]
    B, C = (t.to(dtype).repeat_interleave(heads // t.shape[2], dim=2) for t in (B, C))
    state = hidden_states.new_zeros(*hidden_states.shape[:1], heads, hidden_states.shape[-1], B.shape[-1])
    outputs = []
    for t in range(hidden_states.shape[1]):
        decay = torch.exp(dt[:, t] * A.to(dtype))[..., None, None]
        state = state * decay + (dt[:, t, :, None] * hidden_states[:, t])[..., None] * B[:, t, :, None, :]
        outputs.append((state * C[:, t, :, None, :]).sum(-1))
    y = torch.stack(outputs, dim=1)
    return y if D is None else y + D.to(dtype)[:, None] * hidden_states


def _chunk_gated_delta_rule_in_input_dtype(query, key, value, g, beta, chunk_size=64, initial_state=None,
                                           output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs):
    """transformers' chunk_gated_delta_rule / chunk_kimi_delta_attention contract ([B, T, H, D], zero initial
    state; g per head or per key channel), computed in the input dtype (fp64 stays fp64) by harts_hf's plain
    per-sequence chunked recurrence."""
    from .kernels.tree_gated_delta_rule import gated_delta_rule_chunked

    if initial_state is not None or output_final_state:
        raise ValueError("the fp64 reference kernel runs whole sequences from a zero state only")
    outputs = [gated_delta_rule_chunked(query[row], key[row], value[row], g[row], beta[row],
                                        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, chunk_size=chunk_size)
               for row in range(query.shape[0])]
    return torch.stack(outputs), None


@contextlib.contextmanager
def torch_reference_kernels(float64_recurrence: bool = False):
    """Within the block, transformers' gated-delta-rule and conv1d functions are their pure-PyTorch originals.

    ``float64_recurrence``: the chunked gated delta rule keeps the input dtype instead of transformers' fp32
    (for fp64 reference runs whose only rounding is then transformers' own fp32 norms).
    """
    from .model_patches.cpu_kernels import kernel_fallbacks

    saved = []
    try:
        for name in _KERNEL_MODULES:
            try:
                module = importlib.import_module(name)
            except ImportError:
                continue
            for function, original in kernel_fallbacks(module).items():
                saved.append((module, function, getattr(module, function)))
                setattr(module, function, original)
            for function in _CHUNKED_RECURRENCES + _MAMBA2_SCANS if float64_recurrence else ():
                if hasattr(module, function):
                    saved.append((module, function, getattr(module, function)))
                    setattr(module, function, _mamba2_scan_in_input_dtype if function in _MAMBA2_SCANS
                            else _chunk_gated_delta_rule_in_input_dtype)
        yield
    finally:
        for module, function, current in reversed(saved):
            setattr(module, function, current)


def per_sequence_logprobs(model, sequences, *, compute_entropy: bool = False, temperature: float = 1.0,
                          return_aux_loss: bool = False, float64_recurrence: bool = False):
    """Log-probs ``[len(s_i) - 1]`` per sequence from one plain forward per sequence (pure-torch kernels).

    Returns ``(logprobs, entropies or None, aux_loss or None)``; the aux loss is the family's load-balancing
    loss over the router logits of all sequences together, as a padded batch would give.
    ``float64_recurrence``: see :func:`torch_reference_kernels`.
    """
    device = model.get_input_embeddings().weight.device
    logprobs, entropies, router_logits = [], [], []
    with torch_reference_kernels(float64_recurrence):
        for sequence in sequences:
            ids = torch.as_tensor(sequence, dtype=torch.long, device=device).unsqueeze(0)
            kwargs = {"output_router_logits": True} if return_aux_loss else {}
            outputs = model(input_ids=ids, use_cache=False, **kwargs)  # the model's own head (final softcapping)
            logits = outputs.logits[0, :-1].float() / temperature
            log_probs = logits.log_softmax(-1)
            logprobs.append(log_probs.gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1))
            if compute_entropy:
                entropies.append(-(log_probs.exp() * log_probs).sum(-1))
            if return_aux_loss:
                router_logits.append(outputs.router_logits)
    aux_loss = None
    if return_aux_loss:
        from .model_patches.entry import load_balancing_loss

        layers = [torch.cat([per_sequence[layer] for per_sequence in router_logits]) for layer in range(len(router_logits[0]))]
        aux_loss = load_balancing_loss(model, layers, torch.ones(layers[0].shape[0], device=device))
    return logprobs, (entropies if compute_entropy else None), aux_loss
