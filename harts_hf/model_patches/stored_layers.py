"""Decoder layers that keep their activations under gradient checkpointing.

Whole-layer checkpointing recomputes each decoder layer's forward during the backward: about a third more work
per step. A layer left out of it keeps what its backward needs instead, for more memory.
:func:`store_layer_activations` leaves ``count`` decoder layers out (softmax-attention layers first: their
recompute includes attention over every pair; then the others, spread evenly) and keeps them out each time
checkpointing is enabled again (TRL turns it off around generation and back on after). Checkpointing changes what
is kept, never the arithmetic: the gradients are the same.
"""

from __future__ import annotations

import functools

import torch

from .._checks import check_int

__all__ = ["checkpointed_layers", "store_layer_activations"]

_STORED = "_harts_stored_layers"


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def _choose(layer_types: list[str], count: int) -> list[int]:
    """``count`` layer indices: full-attention layers first, evenly spaced within each kind."""
    attention = [i for i, kind in enumerate(layer_types) if kind == "full_attention"]
    others = [i for i in range(len(layer_types)) if i not in attention]
    if len(attention) == len(layer_types):  # one kind only
        attention, others = [], attention
    chosen = []
    for pool in (attention, others):
        take = min(count - len(chosen), len(pool))
        chosen += [pool[(2 * j + 1) * len(pool) // (2 * take)] for j in range(take)]
    return sorted(chosen)


def store_layer_activations(model: torch.nn.Module, count: int) -> list[int]:
    """Leave ``count`` decoder layers of ``model`` (a transformers model) out of gradient checkpointing, now and
    whenever it is enabled again; 0 checkpoints every layer again. Returns the indices of the stored layers."""
    if hasattr(model, "get_base_model"):  # PEFT: the transformers model the trainer enables checkpointing on
        model = model.get_base_model()
    layers = _decoder_layers(model)
    count = check_int(count, "tree_stored_layers", minimum=0)
    if count > len(layers):
        raise ValueError(f"tree_stored_layers={count} exceeds the model's {len(layers)} decoder layers; pass at most "
                         f"{len(layers)} (every layer keeps its activations) or 0 (every layer is checkpointed)")
    config = getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * len(layers))
    if len(layer_types) != len(layers):
        layer_types = ["full_attention"] * len(layers)
    stored = _choose(layer_types, count)
    enable = getattr(model, "_set_gradient_checkpointing", None)
    if enable is None:
        raise TypeError(f"{type(model).__name__} has no _set_gradient_checkpointing: store_layer_activations needs "
                        "a transformers PreTrainedModel")
    if not hasattr(enable, "__wrapped__"):  # once per model: every later enable keeps the stored layers out
        @functools.wraps(enable)
        def set_gradient_checkpointing(*args, **kwargs):
            enable(*args, **kwargs)
            _apply(model)

        model._set_gradient_checkpointing = set_gradient_checkpointing
    setattr(model, _STORED, stored)
    was_on = any(layer.gradient_checkpointing for layer in layers) or getattr(model, "is_gradient_checkpointing", False)
    if was_on:
        if count == 0:  # back to every layer
            for layer in layers:
                layer.gradient_checkpointing = True
        _apply(model)
    return stored


def _apply(model: torch.nn.Module) -> None:
    layers = _decoder_layers(model)
    if not any(layer.gradient_checkpointing for layer in layers):  # checkpointing was turned off
        return
    for index in getattr(model, _STORED, []):
        layers[index].gradient_checkpointing = False


def checkpointed_layers(model: torch.nn.Module) -> list[int]:
    """Indices of the decoder layers that run under gradient checkpointing now."""
    return [i for i, layer in enumerate(_decoder_layers(model)) if layer.gradient_checkpointing]
