"""What activation checkpointing keeps and what it recomputes, on transformers models.

Whole-layer checkpointing reruns each decoder layer's forward during the backward: about a third more work per
step. Two ways to rerun less, both exact (checkpointing changes what is kept, never the arithmetic; the kernels
involved are deterministic):

- :func:`keep_attention_outputs`: every softmax-attention kernel's output and softmax statistics from the forward are
  kept (a selective-checkpointing policy, ``torch.utils.checkpoint.create_selective_checkpoint_contexts``), so the
  rerun skips the attention itself, the costliest op to recompute per byte kept (one attention output per attention
  layer: ``tokens x heads x head_dim`` in bf16 plus fp32 statistics). The policy's Python dispatch mode sees every op
  it is active for, so it is active only inside the attention modules (transformers' attention classes) of the layers
  that hold them; the rest of the layer, and every other layer, dispatch without it. Needs non-reentrant
  checkpointing; under the reentrant kind it is not applied, nor under DeepSpeed ZeRO-3 (its parameter all-gathers
  inside the checkpointed region are collectives the selective-checkpointing cache refuses to meet in the backward's
  rerun).
- :func:`keep_mixer_outputs`: the tree linear-attention and Mamba-2 nodes' state pass and output stage (fla's
  round-batched nodes, CUDA) are kept from the forward by the same policy (:mod:`harts_hf.kernels.kept`: each node's
  body as one dispatcher op), so the rerun recomputes only their cheap inputs; one node output per such layer
  (:func:`mixer_output_bytes_per_token`). Same conditions as :func:`keep_attention_outputs`.
- :func:`keep_matmul_outputs`: in ``count`` checkpointed decoder layers the policy also keeps every matrix
  product's output (the projections' GEMMs, and the attention), so their rerun recomputes only the cheap per-element
  work between them: most of a layer's recompute FLOPs for about half the memory of leaving the layer out of
  checkpointing (the GEMM outputs, not their fp32 inputs, casts and per-element intermediates). Same conditions as
  :func:`keep_attention_outputs`.
- :func:`store_layer_activations`: ``count`` decoder layers leave checkpointing altogether (softmax-attention
  layers first, then the others spread evenly) and keep everything their backward needs.

All stay in force whenever checkpointing is enabled again (TRL turns it off around generation and back on).
"""

from __future__ import annotations

import functools
import inspect
import threading

import torch
from transformers.utils import logging

from .._checks import check_bool, check_int, check_number
from ..kernels import kept
from .core import zero3_enabled

logger = logging.get_logger(__name__)

__all__ = ["checkpointed_layers", "keep_attention_outputs", "keep_matmul_outputs", "keep_matmul_outputs_within",
           "keep_mixer_outputs", "keep_mixer_outputs_within", "matmul_output_bytes_per_token",
           "mixer_output_bytes_per_token", "store_layer_activations"]

_ORIGINAL = "_harts_original_checkpoint"  # a layer's checkpoint function before the policy was added


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


@functools.cache
def _attention_ops() -> frozenset:
    """The dispatcher ops that compute softmax attention in the kernels tree attention calls (torch's varlen op,
    harts_hf's FlashAttention-4 op, SDPA's fused backends, flash / efficient attention forwards), and the tree nodes'
    kept bodies (``harts::kept_body``, dispatched only where mixer outputs are kept); each present in this torch
    build."""
    import torch.nn.attention.varlen  # noqa: F401  (registers torch_attn::_varlen_attn)

    from ..kernels.tree_attention import fa4  # noqa: F401  (registers harts::fa4_varlen_fwd)

    names = [("torch_attn", "_varlen_attn"), ("harts", "fa4_varlen_fwd"), ("harts", "kept_body")]
    names += [("aten", name) for name in (
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
        "_flash_attention_forward", "_efficient_attention_forward")]
    ops = set()
    for namespace, name in names:
        packet = getattr(getattr(torch.ops, namespace), name, None)
        if packet is not None:
            ops.add(packet.default)
    return frozenset(ops)


@functools.cache
def _matmul_ops() -> frozenset:
    """The dispatcher ops of matrix products (what ``nn.Linear`` and MoE experts reach below autograd), and the
    attention ops."""
    names = ("mm", "addmm", "bmm", "baddbmm", "_grouped_mm")
    return _attention_ops() | frozenset(getattr(torch.ops.aten, name).default for name in names
                                        if hasattr(torch.ops.aten, name))


def _keep_policy(kept_ops, ctx, op, *args, **kwargs):
    """Selective checkpointing: keep the outputs of the ops in ``kept_ops()``, recompute the rest."""
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in kept_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def _contexts(kept_ops):
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(functools.partial(_keep_policy, kept_ops))


_attention_contexts = functools.partial(_contexts, _attention_ops)  # a checkpoint's context_fn
_deferred = threading.local()  # this thread's entered modes (``entered``)


class _Deferred:
    """One of selective checkpointing's two dispatch modes, held open for a checkpointed call but entered only
    around its attention modules' forwards where ``attention`` (:func:`_enter_kept` / :func:`_exit_kept`, their
    hooks) and around the tree nodes' kept bodies where ``mixers`` (:func:`harts_hf.kernels.kept.run`), so the
    layer's other ops dispatch without Python in between. Both passes see the same ops in the same order (the
    attention modules' own, the nodes' bodies), which is all the modes' shared storage needs."""

    def __init__(self, mode, attention: bool, mixers: bool):
        self.mode, self.attention, self.mixers = mode, attention, mixers

    def __enter__(self):
        kept.open_calls().append(self)
        return self

    def __exit__(self, *exc):
        kept.open_calls().pop()
        return False


def _deferred_contexts(attention: bool = True, mixers: bool = False):
    """A checkpoint's ``context_fn``: the keep policy, active inside the attention modules (``attention``) and around
    the tree nodes' kept bodies (``mixers``) only; under torch.compile, which takes dispatch modes only, over the
    whole checkpointed call."""
    forward, recompute = _attention_contexts()
    if torch.compiler.is_compiling():
        return forward, recompute
    return _Deferred(forward, attention, mixers), _Deferred(recompute, attention, mixers)


class _WholeCall:
    """One of selective checkpointing's two dispatch modes entered over a whole checkpointed call (the layers keeping
    their matrix products), announced to the tree nodes' kept bodies where ``mixers`` (they dispatch their op under
    it; ``mode`` None: nothing for them to enter)."""

    def __init__(self, mode, mixers: bool):
        self.inner, self.mode, self.attention, self.mixers = mode, None, False, mixers

    def __enter__(self):
        self.inner.__enter__()
        kept.open_calls().append(self)
        return self

    def __exit__(self, *exc):
        kept.open_calls().pop()
        return self.inner.__exit__(*exc)


def _matmul_contexts(mixers: bool = False):
    """A checkpoint's ``context_fn`` keeping every matrix product and attention output (and, where ``mixers``, the
    tree nodes' kept bodies) over the whole checkpointed call."""
    forward, recompute = _contexts(_matmul_ops)
    if torch.compiler.is_compiling():
        return forward, recompute
    return _WholeCall(forward, mixers), _WholeCall(recompute, mixers)


def _enter_kept(module, args):
    """Forward pre-hook of an attention module: enter the innermost open checkpointed call's mode, if it keeps
    attention outputs."""
    calls = kept.open_calls()
    mode = calls[-1].mode if calls and calls[-1].attention else None
    if mode is not None:
        mode.__enter__()
    _deferred.__dict__.setdefault("entered", []).append(mode)


def _exit_kept(module, args, output):
    """Forward hook of an attention module (also when its forward raises, as checkpointing's early stop of a
    rerun does): leave the mode :func:`_enter_kept` entered."""
    entered = getattr(_deferred, "entered", None)
    mode = entered.pop() if entered else None  # empty only where an earlier pre-hook raised before ours ran
    if mode is not None:
        mode.__exit__(None, None, None)


def _attention_modules(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The softmax-attention modules inside a checkpointed module: those whose ``forward`` goes through transformers'
    attention interface, as every family's attention classes do. Only layers holding one get the keep-attention
    policy: selective checkpointing's Python dispatch mode sees every op it is active for, which in a
    linear-attention, Mamba or MLP-only layer costs host time and keeps nothing."""
    from .core import _uses_attention_interface

    return [m for m in module.modules() if _uses_attention_interface(m)]


def _hook_attention_modules(modules: list[torch.nn.Module]) -> None:
    """Put :func:`_enter_kept` / :func:`_exit_kept` on attention ``modules`` (once each; inert outside a
    checkpointed call with :func:`_deferred_contexts`)."""
    for module in modules:
        if not module.__dict__.get("_harts_kept_hooks"):
            module.register_forward_pre_hook(_enter_kept)
            module.register_forward_hook(_exit_kept, always_call=True)
            module._harts_kept_hooks = True


def _non_reentrant(function) -> bool:
    while isinstance(function, functools.partial):
        if "use_reentrant" in function.keywords:
            return function.keywords["use_reentrant"] is False
        function = function.func
    return False


class _SetGradientCheckpointing:
    """A model's ``_set_gradient_checkpointing``: transformers' own, then harts_hf's settings (``stored`` layer
    indices, ``keep_attention``, ``matmul_count`` and the ``matmul_layers`` chosen for it, ``keep_mixers`` and the
    ``mixer_layers`` chosen for it). ``enabled``: per decoder
    layer, whether transformers' own enabling checkpointed it (every layer, or every n-th with ``every_n_layers`` of
    transformers >= 5.25); a layer it left out stays out whatever the settings. An object holding its model, so a
    deep copy of the model gets its own."""

    def __init__(self, model):
        self.model, self.stored, self.keep_attention, self.matmul_layers, self.matmul_count = model, [], False, [], 0
        self.keep_mixers, self.mixer_layers = False, []
        self.matmul_budget = None  # (bytes, tokens, dtype): the count follows from it (keep_matmul_outputs_within)
        self.mixer_budget = None  # the same for the kept mixer outputs (keep_mixer_outputs_within)
        self.enabled = [layer.gradient_checkpointing for layer in _decoder_layers(model)]  # before the settings came

    def __call__(self, *args, **kwargs):
        type(self.model)._set_gradient_checkpointing(self.model, *args, **kwargs)
        self.enabled = [layer.gradient_checkpointing for layer in _decoder_layers(self.model)]
        _choose_matmul_layers(self)
        _choose_mixer_layers(self)
        _apply(self.model)


def _settings(model) -> _SetGradientCheckpointing:
    if hasattr(model, "get_base_model"):  # PEFT: the transformers model the trainer enables checkpointing on
        model = model.get_base_model()
    enable = getattr(type(model), "_set_gradient_checkpointing", None)
    if enable is None or "value" in inspect.signature(enable).parameters:
        raise TypeError(f"{type(model).__name__} has no _set_gradient_checkpointing(enable, ...) of transformers >= "
                        "4.35: harts_hf's checkpointing settings need a transformers PreTrainedModel")
    if not isinstance(model.__dict__.get("_set_gradient_checkpointing"), _SetGradientCheckpointing):
        model._set_gradient_checkpointing = _SetGradientCheckpointing(model)
    return model._set_gradient_checkpointing


def _apply(model: torch.nn.Module) -> None:
    """Put the model's settings on its checkpointed modules (after transformers enabled checkpointing)."""
    settings = model._set_gradient_checkpointing
    layers = _decoder_layers(model)
    if not _checkpointing_on(model, layers):
        return
    selective = not zero3_enabled()
    matmul_layers = {id(layers[i]) for i in settings.matmul_layers if i < len(layers)}
    mixer_layers = {id(layers[i]) for i in settings.mixer_layers if i < len(layers)}
    refused = False  # a policy asked for that this checkpointing cannot take
    for module in model.modules():
        function = getattr(module, "_gradient_checkpointing_func", None)
        if function is None:
            continue
        original = getattr(function, _ORIGINAL, function)
        attention = _attention_modules(module) if settings.keep_attention else []
        mixers = id(module) in mixer_layers
        if id(module) in matmul_layers:
            contexts = functools.partial(_matmul_contexts, mixers=mixers)
        elif attention or mixers:
            contexts = functools.partial(_deferred_contexts, attention=bool(attention), mixers=mixers)
        else:
            contexts = None
        if selective and contexts is not None and _non_reentrant(original):
            function = functools.partial(original, context_fn=contexts)
            setattr(function, _ORIGINAL, original)
            _hook_attention_modules(attention)
        else:
            refused |= contexts is not None
            function = original
        module._gradient_checkpointing_func = function
    if refused:
        why = "DeepSpeed ZeRO-3 cannot run" if not selective else "reentrant checkpointing cannot take"
        logger.warning_once(
            "harts_hf keeps attention outputs (tree_keep_attention_outputs) and matrix products (tree_keep_matmul_*) "
            f"through a selective-checkpointing policy, which {why}: the backward reruns them instead (the same "
            "gradients). Non-reentrant checkpointing (transformers' default, gradient_checkpointing_kwargs="
            "{'use_reentrant': False}) outside ZeRO-3 keeps them.")
    enabled = _enabled_by_transformers(settings, len(layers))
    for index, layer in enumerate(layers):
        layer.gradient_checkpointing = enabled[index] and index not in settings.stored


def _checkpointing_on(model, layers) -> bool:
    """Whether checkpointing is enabled: transformers sets every module's flag, layers' and others' alike (the
    decoder's own, e.g.); the layers' alone may all be off because every layer is stored."""
    others = [m.gradient_checkpointing for m in model.modules() if hasattr(m, "gradient_checkpointing")
              and m not in layers and isinstance(m.gradient_checkpointing, bool)]
    return any(others) if others else any(layer.gradient_checkpointing for layer in layers)


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
    settings = _settings(model)
    _update(settings, stored=_count_layers(settings.model, count, "tree_stored_layers"))
    return settings.stored


def _count_layers(model: torch.nn.Module, count: int, name: str) -> list[int]:
    """``count`` decoder layer indices of ``model`` by :func:`_choose` (``name``: the setting, for errors)."""
    layers = _decoder_layers(model)
    count = check_int(count, name, minimum=0)
    if count > len(layers):
        raise ValueError(f"{name}={count} exceeds the model's {len(layers)} decoder layers; pass at most "
                         f"{len(layers)} (every layer) or 0 (none)")
    return _choose(_layer_types(model, len(layers)), count)


def _layer_types(model: torch.nn.Module, count: int) -> list[str]:
    """The config's ``layer_types`` (``count`` of them), or every layer ``full_attention`` where it has none."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    layer_types = list(getattr(config, "layer_types", None) or [])
    return layer_types if len(layer_types) == count else ["full_attention"] * count


def _enabled_by_transformers(settings: _SetGradientCheckpointing, count: int) -> list[bool]:
    """``settings.enabled`` for ``count`` decoder layers; every layer while checkpointing is off (as transformers'
    enabling checkpoints them unless ``every_n_layers`` says otherwise)."""
    return settings.enabled if any(settings.enabled) and len(settings.enabled) == count else [True] * count


def _choose_matmul_layers(settings: _SetGradientCheckpointing) -> None:
    """``settings.matmul_layers``: ``settings.matmul_count`` of the layers that run checkpointed (not stored, not
    left out by transformers' own enabling), by :func:`_choose` among them."""
    layers = _decoder_layers(settings.model)
    enabled = _enabled_by_transformers(settings, len(layers))
    pool = [i for i in range(len(layers)) if enabled[i] and i not in settings.stored]
    types = [_layer_types(settings.model, len(layers))[i] for i in pool]
    if settings.matmul_budget is not None:  # the most layers whose products fit
        budget, tokens, dtype = settings.matmul_budget
        per_token = matmul_output_bytes_per_token(settings.model, dtype)
        settings.matmul_count = max(count for count in range(len(pool) + 1) if tokens * sum(
            per_token[pool[j]] for j in _choose(types, count)) <= budget)
    if settings.matmul_count > len(pool):
        raise ValueError(f"tree_keep_matmul_layers={settings.matmul_count} exceeds the model's {len(pool)} "
                         f"checkpointed decoder layers (of {len(layers)}; {len(settings.stored)} stored by "
                         f"tree_stored_layers, {enabled.count(False)} left out by transformers' every_n_layers); pass "
                         f"at most {len(pool)}, or 0 (none)")
    settings.matmul_layers = [pool[j] for j in _choose(types, settings.matmul_count)]


def keep_matmul_outputs(model: torch.nn.Module, count: int) -> list[int]:
    """Under non-reentrant gradient checkpointing, keep every matrix product's output from the forward in ``count``
    checkpointed decoder layers of ``model`` (softmax-attention layers first, then the others spread evenly; never a
    layer :func:`store_layer_activations` stores or transformers' ``every_n_layers`` leaves out: the choice follows
    those), so their rerun in the backward skips the GEMMs; now and whenever checkpointing is enabled again; 0 turns
    it off. Returns the layers' indices. The gradients are the same (checkpointing changes what is kept, not the
    arithmetic)."""
    settings = _settings(model)
    _update(settings, matmul_count=check_int(count, "tree_keep_matmul_layers", minimum=0), matmul_budget=None)
    return settings.matmul_layers


def keep_matmul_outputs_within(model: torch.nn.Module, gib: float, tokens: int,
                               dtype: torch.dtype = torch.bfloat16) -> list[int]:
    """:func:`keep_matmul_outputs` in as many checkpointed layers as fit in ``gib`` GiB at ``tokens`` tokens per
    forward (a planner piece's most: ``tree_token_budget``), by :func:`matmul_output_bytes_per_token` in ``dtype``
    (autocast's); the count is worked out again whenever the checkpointed layers change. 0 GiB keeps none. Returns
    the layers' indices."""
    gib = check_number(gib, "tree_keep_matmul_gib", allow_zero=True)
    tokens = check_int(tokens, "tree_token_budget")
    settings = _settings(model)
    _update(settings, matmul_budget=(gib * 2**30, tokens, dtype))
    return settings.matmul_layers


def _update(settings: _SetGradientCheckpointing, **values) -> None:
    """Set ``values`` on ``settings``, choose the kept-product and kept-mixer layers again and apply; on an error (a
    count that no longer fits) the settings stay as they were."""
    before = {name: getattr(settings, name) for name in ("stored", "matmul_count", "matmul_budget", "matmul_layers",
                                                          "keep_mixers", "mixer_budget", "mixer_layers")}
    for name, value in values.items():
        setattr(settings, name, value)
    try:
        _choose_matmul_layers(settings)
        _choose_mixer_layers(settings)
    except ValueError:
        for name, value in before.items():
            setattr(settings, name, value)
        raise
    _apply(settings.model)


def matmul_output_bytes_per_token(model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16) -> list[int]:
    """Per decoder layer of ``model``, the bytes per token that :func:`keep_matmul_outputs` keeps in that layer for the
    step: every ``nn.Linear``'s output (``out_features`` values in ``dtype``, autocast's dtype; an adapter's own
    products counted too). Not counted: MoE experts' grouped products (per routed token), and the attention output,
    which :func:`keep_attention_outputs` keeps anyway. Times the tokens of one forward (a planner piece's), summed
    over the layers chosen (:func:`keep_matmul_outputs` returns their indices), it is what keeping them costs."""
    size = torch.empty((), dtype=dtype).element_size()
    return [sum(m.out_features for m in layer.modules() if isinstance(m, torch.nn.Linear)) * size
            for layer in _decoder_layers(model)]


def keep_attention_outputs(model: torch.nn.Module, enable: bool = True) -> None:
    """Under non-reentrant gradient checkpointing, keep every softmax-attention kernel's output from the forward
    instead of rerunning the attention in the backward (now and whenever checkpointing is enabled again)."""
    settings = _settings(model)
    settings.keep_attention = check_bool(enable, "tree_keep_attention_outputs")
    _apply(settings.model)


def keep_mixer_outputs(model: torch.nn.Module, enable: bool = True) -> None:
    """Under non-reentrant gradient checkpointing, keep each checkpointed layer's tree linear-attention and Mamba-2
    nodes' state pass and output stage from the forward instead of rerunning them in the backward (Gated DeltaNet,
    Kimi Delta Attention and Mamba-2 on fla's round-batched nodes, CUDA; the CPU's torch nodes rerun as before), now
    and whenever checkpointing is enabled again. Costs :func:`mixer_output_bytes_per_token` per token of a forward;
    the gradients are the same (checkpointing changes what is kept, not the arithmetic). Not under reentrant
    checkpointing or ZeRO-3 (as :func:`keep_attention_outputs`), nor where the Gated DeltaNet node runs as CUDA
    graphs (``cuda_graphs.MAX_TOKENS``)."""
    _update(_settings(model), keep_mixers=check_bool(enable, "tree_keep_mixer_outputs"), mixer_budget=None)


def keep_mixer_outputs_within(model: torch.nn.Module, gib: float, tokens: int,
                              dtype: torch.dtype = torch.bfloat16) -> list[int]:
    """:func:`keep_mixer_outputs` in as many checkpointed decoder layers holding a tree mixer as fit in ``gib`` GiB at
    ``tokens`` tokens per forward (a planner piece's most: ``tree_token_budget``), by
    :func:`mixer_output_bytes_per_token` in ``dtype`` (autocast's), spread evenly over those layers; worked out again
    whenever the checkpointed layers change. 0 GiB keeps none. Returns the layers' indices."""
    gib = check_number(gib, "tree_keep_mixer_gib", allow_zero=True)
    tokens = check_int(tokens, "tree_token_budget")
    settings = _settings(model)
    _update(settings, keep_mixers=True, mixer_budget=(gib * 2**30, tokens, dtype))
    return settings.mixer_layers


def _choose_mixer_layers(settings: _SetGradientCheckpointing) -> None:
    """``settings.mixer_layers``: where ``settings.keep_mixers``, the checkpointed layers (not stored, not left out
    by transformers' own enabling) holding a tree mixer; with ``settings.mixer_budget``, as many of them as fit,
    evenly spaced."""
    if not settings.keep_mixers:
        settings.mixer_layers = []
        return
    layers = _decoder_layers(settings.model)
    enabled = _enabled_by_transformers(settings, len(layers))
    budget, tokens, dtype = settings.mixer_budget or (None, 0, torch.bfloat16)
    per_token = mixer_output_bytes_per_token(settings.model, dtype)
    pool = [i for i in range(len(layers)) if enabled[i] and i not in settings.stored and per_token[i]]
    count = len(pool)
    if budget is not None:  # the most layers whose outputs fit
        count = max(n for n in range(len(pool) + 1)
                    if tokens * sum(per_token[pool[j]] for j in _choose(["mixer"] * len(pool), n)) <= budget)
    settings.mixer_layers = [pool[j] for j in _choose(["mixer"] * len(pool), count)]


def mixer_output_bytes_per_token(model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16) -> list[int]:
    """Per decoder layer of ``model``, the bytes per token :func:`keep_mixer_outputs` keeps there: each tree mixer's
    output, ``value heads x value head dim`` in ``dtype`` (autocast's; Mamba-2's ``heads x head_dim``). The requested
    states of a planner piece's hand-offs (a few per piece) are not counted."""
    from .core import tree_mixer_output_width

    size = torch.empty((), dtype=dtype).element_size()
    return [sum(tree_mixer_output_width(m) for m in layer.modules()) * size for layer in _decoder_layers(model)]


def checkpointed_layers(model: torch.nn.Module) -> list[int]:
    """Indices of the decoder layers that run under gradient checkpointing now."""
    return [i for i, layer in enumerate(_decoder_layers(model)) if layer.gradient_checkpointing]
