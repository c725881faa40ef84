"""The obviously-right baseline: run the model on every sequence alone and read off its log-probs.

``torch_reference_kernels()`` makes transformers' Qwen3-Next / Qwen3.5 layers use their pure-PyTorch
kernels even when fla / causal-conv1d (and triton) are importable, so CPU references never reach Triton.
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
)
_KERNEL_FUNCTIONS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                     "causal_conv1d_update")


@contextlib.contextmanager
def torch_reference_kernels():
    """Within the block, transformers' gated-delta-rule and conv1d functions are their pure-PyTorch originals."""
    saved = []
    try:
        for name in _KERNEL_MODULES:
            try:
                module = importlib.import_module(name)
            except ImportError:
                continue
            for function in _KERNEL_FUNCTIONS:
                current = getattr(module, function, None)
                original = getattr(current, "__wrapped__", None)
                if original is not None:
                    saved.append((module, function, current))
                    setattr(module, function, original)
        yield
    finally:
        for module, function, current in reversed(saved):
            setattr(module, function, current)


def per_sequence_logprobs(model, sequences, *, compute_entropy: bool = False, temperature: float = 1.0,
                          return_aux_loss: bool = False):
    """Log-probs ``[len(s_i) - 1]`` per sequence from one plain forward per sequence (pure-torch kernels).

    Returns ``(logprobs, entropies or None, aux_loss or None)``; the aux loss is the family's load-balancing
    loss over the router logits of all sequences together, as a padded batch would give.
    """
    device = model.get_input_embeddings().weight.device
    logprobs, entropies, router_logits = [], [], []
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    with torch_reference_kernels():
        for sequence in sequences:
            ids = torch.as_tensor(sequence, dtype=torch.long, device=device).unsqueeze(0)
            kwargs = {"output_router_logits": True} if return_aux_loss else {}
            outputs = decoder(input_ids=ids, use_cache=False, **kwargs)
            logits = head(outputs.last_hidden_state[0, :-1]).float() / temperature
            log_probs = logits.log_softmax(-1)
            logprobs.append(log_probs.gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1))
            if compute_entropy:
                entropies.append(-(log_probs.exp() * log_probs).sum(-1))
            if return_aux_loss:
                router_logits.append(outputs.router_logits)
    aux_loss = None
    if return_aux_loss:
        from .logprobs import _load_balancing_loss

        layers = [torch.cat([per_sequence[layer] for per_sequence in router_logits]) for layer in range(len(router_logits[0]))]
        aux_loss = _load_balancing_loss(model, layers, torch.ones(layers[0].shape[0], device=device))
    return logprobs, (entropies if compute_entropy else None), aux_loss
