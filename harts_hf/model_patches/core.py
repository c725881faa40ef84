"""apply_tree_patches: switch a live transformers model to tree execution, and back.

Only the token mixers change. Attention modules dispatch to the registered ``"harts_tree"`` attention
function (through a per-module copy of the config, so the model's own config, masks and generation stay
as they were); Gated DeltaNet modules get an instance-level ``forward`` that runs the tree kernels. Both
fall through to the original code whenever the call carries no ``harts_tree`` keyword argument. The root
model's ``forward`` also serves ``harts_tree_request`` calls (see ``entry.py``). Per-token modules (RMSNorms, the
gated norm, SwiGLU MLPs) get forwards that run fused kernels on CUDA inputs and their own code otherwise
(``token_modules.py``).
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import inspect
import math
import re
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..kernels import TreeMetadata, tree_attention
from ..kernels.tree_attention.ops import autocast_inputs

__all__ = ["PatchHandle", "PatchedForward", "TreeFamily", "apply_tree_patches", "chunk_grid", "cpu_safe",
           "register_family", "supported_model_types",
           "TREE_ATTENTION_NAME", "TREE_KWARG"]

TREE_ATTENTION_NAME = "harts_tree"
TREE_KWARG = "harts_tree"  # the keyword argument that carries TreeMetadata through the model
_PATCH_MARK = "_harts_tree_patch"
_DENSE_MASK_TOKENS = 8192  # "auto" attention off CUDA: dense mask up to this many packed tokens, then per-run SDPA
_IN_TREE_FORWARD = contextvars.ContextVar("harts_tree_forward", default=False)


@contextlib.contextmanager
def tree_forward_running():
    """Marks a tree forward of the decoder: an attention call without tree metadata inside it raises."""
    token = _IN_TREE_FORWARD.set(True)
    try:
        yield
    finally:
        _IN_TREE_FORWARD.reset(token)


@dataclass
class TreeFamily:
    """How to run one model family on a tree.

    ``attention_classes``: class names of softmax-attention mixers; ``linear_classes``: class name ->
    ``forward`` factory for linear-attention mixers; ``moe``: the family has routed experts (and harts_hf weights
    their load-balancing loss by multiplicity).
    """

    model_types: tuple[str, ...]
    attention_classes: tuple[str, ...] = ()
    linear_classes: dict[str, Callable] = field(default_factory=dict)
    moe: bool = False
    generic: bool = False  # found by attention_interface_family, not registered


_REGISTRY: dict[str, TreeFamily] = {}


def register_family(family: TreeFamily) -> None:
    for model_type in family.model_types:
        _REGISTRY[model_type] = family


TESTED_BY_STRUCTURE = ("cohere2", "deepseek_v2", "deepseek_v3", "gemma2", "gemma3_text", "glm4_moe", "gpt2", "gpt_oss",
                       "granite", "mistral", "mixtral", "olmo2", "opt", "phi3")
"""Model types without a family file that :func:`attention_interface_family` finds and the tests check against
per-sequence runs and GRPOTrainer (tests/test_attention_families.py); any other model of that structure runs too."""


def supported_model_types() -> list[str]:
    """The registered families and the model types tested through :func:`attention_interface_family`."""
    _load_families()
    return sorted(set(_REGISTRY) | set(TESTED_BY_STRUCTURE))


def _load_families() -> None:
    """Import every family module (each registers its families when imported). Not keyed on an empty registry:
    importing one family module first (``harts_hf.model_patches.mamba2`` for its setting) registers only its own."""
    from . import full_attention, kimi_delta_attention, mamba2, olmo_hybrid, qwen3_5, qwen3_next  # noqa: F401


class PatchedForward:
    """An instance ``forward`` that hands every call to ``handler(module, original_forward, *args, **kwargs)``.

    It shares nothing between modules: it reports the replaced forward's signature (``inspect.signature``), pickles
    and deep-copies with its module (the copy's forward serves the copy), and holds the replaced forward as its
    unbound function where that is the module's own method, so no bound method outlives the module."""

    def __init__(self, module: torch.nn.Module, original: Callable, handler: Callable):
        self.module, self.handler = module, handler
        own = isinstance(original, types.MethodType) and original.__self__ is module
        self.function, self.other = (original.__func__, None) if own else (None, original)

    def original(self) -> Callable:
        return self.other if self.function is None else types.MethodType(self.function, self.module)

    def __call__(self, *args, **kwargs):
        return self.handler(self.module, self.original(), *args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self.original())

    def __reduce__(self):
        return _rebuild_forward, (self.module, self.function, self.other, self.handler)

    def __repr__(self) -> str:
        return f"<harts_hf forward of {type(self.module).__name__} via {getattr(self.handler, '__name__', self.handler)}>"


def _rebuild_forward(module, function, other, handler) -> PatchedForward:
    forward = PatchedForward.__new__(PatchedForward)
    forward.module, forward.handler, forward.function, forward.other = module, handler, function, other
    return forward


class PatchHandle:
    """Undo record of :func:`apply_tree_patches`; ``revert()`` restores every replaced attribute."""

    def __init__(self, model, family: TreeFamily):
        self.model = model
        self.family = family
        self._undo: list[tuple[object, str, object, bool]] = []
        self.attention_modules: list[torch.nn.Module] = []
        self.linear_modules: list[torch.nn.Module] = []
        self.active = True

    def _set(self, obj, name: str, value) -> None:
        had = name in vars(obj)
        self._undo.append((obj, name, vars(obj).get(name), had))
        setattr(obj, name, value)

    def revert(self) -> None:
        """Restore the model exactly as it was before :func:`apply_tree_patches`."""
        if not self.active:
            return
        for obj, name, old, had in reversed(self._undo):
            if had:
                setattr(obj, name, old)
            else:
                delattr(obj, name)
        self._undo.clear()
        self.active = False
        if getattr(self.model, _PATCH_MARK, None) is self:
            delattr(self.model, _PATCH_MARK)

    def __getstate__(self) -> dict:  # pickled with the model (torch.save): a registered family by its key
        state = dict(vars(self))
        if self.family is not None and not self.family.generic:
            state["family"] = self.family.model_types[0]
        return state

    def __setstate__(self, state: dict) -> None:
        _load_families()
        if isinstance(state["family"], str):
            state["family"] = _REGISTRY[state["family"]]
        vars(self).update(state)

    def __enter__(self) -> PatchHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.revert()

    def __repr__(self) -> str:
        state = "active" if self.active else "reverted"
        return (f"PatchHandle({type(self.model).__name__}, {len(self.attention_modules)} attention + "
                f"{len(self.linear_modules)} linear-attention mixers, {state})")


def tree_mixer_output_width(module: torch.nn.Module) -> int:
    """The width of a tree linear-attention or Mamba-2 mixer's node output per token (its output projection's input:
    value heads x value head dim), 0 for any other module."""
    _load_families()
    if not any(type(module).__name__ in family.linear_classes for family in _REGISTRY.values()):
        return 0
    projection = getattr(module, "out_proj", None) or getattr(module, "o_proj", None)
    if projection is None or not hasattr(projection, "in_features"):
        raise TypeError(f"{type(module).__name__} has no out_proj / o_proj with in_features: harts_hf cannot size "
                        "its kept node outputs (tree_keep_mixer_outputs)")
    return projection.in_features


def _uses_attention_interface(module: torch.nn.Module) -> bool:
    code = getattr(inspect.unwrap(type(module).forward), "__code__", None)  # through decorators (deprecate_kwarg)
    return code is not None and "ALL_ATTENTION_FUNCTIONS" in code.co_names


def attention_interface_family(model) -> TreeFamily | None:
    """A family for a model that needs nothing beyond softmax attention, found by its structure: the decoder takes
    positions from ``position_ids`` (which tree execution sets to depths) through a rotary embedding or a learned
    position table (GPT-2's ``wpe``, OPT's ``embed_positions``: an embedding beside the token embedding; ALiBi, which
    reads the attention mask, has neither), and every decoder layer holds exactly one module whose ``forward`` goes
    through transformers' attention interface (``ALL_ATTENTION_FUNCTIONS``); :func:`check_decoder_layers` then
    refuses anything else in a layer that is not per-token, and :func:`.entry.check_tree_forward` probes the result.
    None if the model does not look like that."""
    try:
        layers = decoder_layers(model)
    except ValueError:
        return None
    tokens = model.get_input_embeddings()
    positions = [m for m in model.get_decoder().children() if "RotaryEmbedding" in type(m).__name__
                 or (isinstance(m, torch.nn.Embedding) and m is not tokens)]
    if not layers or not positions:
        return None
    names = set()
    for _, layer in layers:
        found = [m for m in layer.modules() if _uses_attention_interface(m)]
        if len(found) != 1:
            return None
        names.add(type(found[0]).__name__)
    moe = hasattr(sys.modules[type(model).__module__], "load_balancing_loss_func")  # routed experts with an aux loss
    return TreeFamily(model_types=(model_type_of(model),), attention_classes=tuple(sorted(names)), moe=moe,
                      generic=True)


def model_type_of(model) -> str:
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(f"apply_tree_patches expects a transformers PreTrainedModel, got {type(model).__name__}")
    return config.model_type


def chunk_grid(model) -> int:
    """The chunk grid the planner should cut ``model``'s forests on: the least common multiple of
    :data:`~harts_hf.trees.CHUNK_SIZE` (fla's chunks for Gated DeltaNet and KDA) and every Mamba-2 mixer's scan grid
    (:data:`.mamba2.CHUNK_SIZE`, 64, or where that is None the mixer's own ``chunk_size``: Nemotron-H's 128,
    Falcon-H1's ``mamba_chunk_size``). A cut on this grid hands the state over with nothing replayed in any layer; a
    model without such mixers (or of no registered family) gets ``CHUNK_SIZE``."""
    from ..trees import CHUNK_SIZE
    from .mamba2 import scan_chunk_size

    _load_families()
    family = _REGISTRY.get(getattr(getattr(model, "config", None), "model_type", None))
    grid = CHUNK_SIZE
    for module in model.modules() if family is not None and family.linear_classes else ():
        size = getattr(module, "chunk_size", None) if type(module).__name__ in family.linear_classes else None
        if isinstance(size, int) and size > 0:  # a Mamba-2 mixer (the gated-delta-rule ones have no chunk_size)
            size = scan_chunk_size(module)
            grid = math.lcm(grid, size)
    return grid


def apply_tree_patches(model) -> PatchHandle:
    """Patch ``model`` (a live transformers model) for tree execution; returns a :class:`PatchHandle`.

    Calls without the ``harts_tree`` keyword argument behave exactly as before (CPU calls of mixers transformers
    bound to Triton kernels run their PyTorch kernels, see :mod:`.cpu_kernels`). Raises ``ValueError`` for a model
    type with no tree support, listing the supported ones, and for a decoder layer holding a module that is neither
    one of the family's mixers nor a per-token module (norm, MLP, MoE), naming its path and class.
    """
    _load_families()
    model_type = model_type_of(model)
    family = _REGISTRY.get(model_type) or attention_interface_family(model)
    if family is None:
        raise ValueError(
            f"model_type {model_type!r} has no tree execution in harts_hf; supported: {', '.join(supported_model_types())}, "
            "and any causal LM whose every decoder layer attends through transformers' attention interface "
            "(ALL_ATTENTION_FUNCTIONS) with rotary positions and per-token modules besides. "
            "Train it without trees (TreeGRPOConfig(use_tree=False)) or add a family in harts_hf/model_patches.")
    existing = getattr(model, _PATCH_MARK, None)
    if existing is not None and existing.active:
        raise RuntimeError("this model is already patched for tree execution; call handle.revert() first")
    if model.get_output_embeddings() is None:
        raise ValueError(f"apply_tree_patches: {type(model).__name__} has no LM head (get_output_embeddings() is "
                         "None) to score tokens with; load a causal LM (AutoModelForCausalLM), not a base model "
                         "(AutoModel).")
    check_decoder_layers(model, family)
    handle = PatchHandle(model, family)
    try:
        _patch_mixers(handle)
    except BaseException:
        handle.revert()
        raise
    return handle


def _patch_mixers(handle: PatchHandle) -> None:
    model, family = handle.model, handle.family
    guard_cpu_kernels(handle)
    from .token_modules import token_module_forwards

    for module, attributes in list(token_module_forwards(model)):
        for attribute, value in attributes.items():
            handle._set(module, attribute, value)
    for module in model.modules():
        name = type(module).__name__
        if name in family.attention_classes:
            _patch_attention(handle, module)
        elif name in family.linear_classes:
            for attribute, value in family.linear_classes[name](module).items():
                handle._set(module, attribute, value)
            handle.linear_modules.append(module)
    if not handle.attention_modules and not handle.linear_modules:
        raise ValueError(f"found no {family.attention_classes + tuple(family.linear_classes)} modules in "
                         f"{type(model).__name__}; is this a {model_type_of(model)} model?")
    from .entry import check_logit_transform, check_tree_forward, serve_tree_requests

    checkable = not zero3_enabled() and not any(p.is_meta for p in model.parameters())
    if checkable:
        check_logit_transform(model)  # unpatched calls: what the model computes now
    handle._set(model, "forward", PatchedForward(model, model.forward, serve_tree_requests))
    handle._set(model, _PATCH_MARK, handle)
    if checkable and family.generic:
        check_tree_forward(model)
    _register_zero3_external_parameters(model, handle)


def cpu_safe(model) -> PatchHandle:
    """Make the CPU forwards of an unpatched ``model`` safe where transformers bound Triton kernels into it (triton
    installed): its mixers then run their PyTorch kernels on CPU inputs. Returns the handle whose ``revert()``
    undoes it; :func:`apply_tree_patches` does this too."""
    return guard_cpu_kernels(PatchHandle(model, None))


def guard_cpu_kernels(handle: PatchHandle) -> PatchHandle:
    """Give the mixers of ``handle.model`` that transformers bound to Triton kernels their CPU-safe forward
    (:func:`.cpu_kernels.cpu_guard_attributes`), recorded in ``handle``."""
    from .cpu_kernels import cpu_guard_attributes

    for module, attributes in cpu_guard_attributes(handle.model):
        for attribute, value in attributes.items():
            handle._set(module, attribute, value)
    return handle


# direct children of a decoder layer that act on each token alone (tree execution runs them once per unique token)
_PER_TOKEN_CLASS = re.compile(
    r"(Norm|RMSNorm|LayerNorm|LayerNorm1P|MLP|Mlp|MoeBlock|MoEBlock|MoELayer|MoE|Moe|Experts|Dropout|Identity)$")


def _per_token(module: torch.nn.Module) -> bool:
    """A decoder layer's child that acts on each token alone: named as a norm, MLP, MoE block or dropout, a plain
    ``nn.Linear`` (OPT's ``fc1``/``fc2``), or an activation function (transformers' or torch's,
    ``MultiheadAttention`` excepted)."""
    cls = type(module)
    if _PER_TOKEN_CLASS.search(cls.__name__) or cls is torch.nn.Linear:
        return True
    activation = cls.__module__ in ("transformers.activations", "torch.nn.modules.activation")
    return activation and not isinstance(module, torch.nn.MultiheadAttention)


def decoder_layers(model) -> list[tuple[str, torch.nn.Module]]:
    """``[(path, layer)]`` of the decoder's layers (``model.get_decoder().layers``, or ``.h`` in GPT-2-style
    models), paths as in ``model.named_modules()``."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        layers = getattr(decoder, "h", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no decoder layers at get_decoder().layers (or .h); harts_hf "
                         "finds the token mixers it must patch there")
    paths = {id(module): path for path, module in model.named_modules()}
    return [(paths[id(layer)], layer) for layer in layers]


def check_decoder_layers(model, family: TreeFamily) -> None:
    """Every direct child of every decoder layer is one of ``family``'s mixer classes (by exact class name: a
    subclass may compute something else), holds one, or is a per-token module; anything else would run on the
    packed forest as if it were one sequence, so it raises naming the module's path and class."""
    known = set(family.attention_classes) | set(family.linear_classes)
    for path, layer in decoder_layers(model):
        for name, child in layer.named_children():
            if type(child).__name__ in known or _per_token(child):
                continue
            if any(type(inner).__name__ in known for inner in child.modules()):
                continue
            raise ValueError(
                f"harts_hf cannot run {path}.{name} ({type(child).__module__}.{type(child).__qualname__}) on a "
                f"prefix forest: the {family.model_types[0]} family knows the mixers {', '.join(sorted(known))} "
                "(by exact class name) and per-token modules (norms, MLPs, MoE blocks). Use the family's own "
                "class, register a TreeFamily for this module, or train without trees (TreeGRPOConfig(use_tree=False)).")


SHARED_CASTS = False
"""Whether :func:`autocast_copies` shares one cast; False (the default): each product casts its input as autocast
does. The benchmarks' ``fused_fa4_shared_casts`` kernel set turns it on: on the H200 full-size ``tau``'s tree step
took 5.01 against 5.08 s (inside the runs' spread) and peaked 1.1 GiB lower (BENCHMARKS.md)."""


def autocast_copies(x: torch.Tensor, count: int, through: tuple = ()) -> list[torch.Tensor]:
    """``count`` inputs for ``count`` matrix products of the same activation ``x`` under autocast, cast once.
    ``through``: the modules the products run in; unless each is a :func:`plain_linear`, ``x`` is passed as it is
    (an adapter, e.g. PEFT's LoRA, sees its input as it came).

    Autocast casts a product's activation input to its dtype at every call (it caches casts of weights only), and
    in the backward turns each product's input gradient back into ``x``'s dtype before they are summed: for an fp32
    residual stream feeding q/k/v/z projections, one fp32 read and one bf16 write per projection forward, and a cast
    plus an fp32 sum per projection backward. Here ``x`` is cast once (the same rounding autocast applies, so every
    product sees the same bits) and the gradients are summed in ``x``'s dtype in one buffer. Without autocast, or
    when ``x`` is already in autocast's dtype, ``x`` itself ``count`` times."""
    device = x.device.type
    if not SHARED_CASTS or not torch.is_autocast_enabled(device) or not x.is_floating_point():
        return [x] * count
    dtype = torch.get_autocast_dtype(device)
    if x.dtype == dtype or count < 2 or not all(map(plain_linear, through)):
        return [x] * count
    if not (torch.is_grad_enabled() and x.requires_grad):
        return [x.to(dtype)] * count
    return list(_CastOnce.apply(x, dtype, count))


class _CastOnce(torch.autograd.Function):
    """``x.to(dtype)`` as ``count`` outputs; the backward sums their gradients into one buffer of ``x``'s dtype."""

    @staticmethod
    def forward(ctx, x, dtype, count):
        ctx.input_dtype = x.dtype
        y = x.to(dtype)
        return tuple(y.view_as(y) for _ in range(count))

    @staticmethod
    def backward(ctx, *grads):
        total = None
        for grad in grads:
            if grad is not None:
                total = grad.to(ctx.input_dtype) if total is None else total.add_(grad)
        return total, None, None


def plain_linear(linear) -> bool:
    """A bias-free ``nn.Linear`` whose weight can be read outside its own forward (no adapter, hook or ZeRO-3
    partitioning between the module and its weight); anything else runs through its own forward."""
    return (type(linear) is torch.nn.Linear and linear.bias is None and not linear._forward_hooks
            and not linear._forward_pre_hooks and not hasattr(linear, "_hf_hook") and not zero3_enabled()
            and type(linear.weight) in (torch.Tensor, torch.nn.Parameter))


def zero3_enabled() -> bool:
    """DeepSpeed ZeRO-3 is on (transformers' global flag, set by the Trainer's DeepSpeed config)."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    return is_deepspeed_zero3_enabled()


def _register_zero3_external_parameters(model, handle: PatchHandle) -> None:
    """Under DeepSpeed ZeRO-3 a parameter is gathered only while its own module's forward runs, and every
    module call is a collective that each process must issue equally often. The tree path reads some parameters
    inside another module's forward: the depthwise conv weight and bias inside the Gated DeltaNet mixer (the tree
    conv gathers ancestor windows instead of calling ``conv1d``); the gated norm's weight, applied to blocks of
    rows whose count follows each process's own token count (its ``forward`` is called per block, not the module:
    one module call per block hung 2 processes with different block counts); the LM head's weight inside the
    model's forward (the chunked head projects with it directly, for the same reason per chunk). Registering them
    as external parameters of that module makes ZeRO-3 gather them there (forward and backward)."""
    if not zero3_enabled():
        return
    import deepspeed

    for module in handle.linear_modules:
        for child in (getattr(module, "conv1d", None), getattr(module, "norm", None)):
            for parameter in () if child is None else child.parameters(recurse=False):
                deepspeed.zero.register_external_parameter(module, parameter)
    head = model.get_output_embeddings()
    if head is not None:
        for parameter in (head.weight, getattr(head, "bias", None)):
            if parameter is not None:
                deepspeed.zero.register_external_parameter(model, parameter)


# ---------------------------------------------------------------------------- attention
def _patch_attention(handle: PatchHandle, module: torch.nn.Module) -> None:
    if module.config._attn_implementation == TREE_ATTENTION_NAME:
        raise RuntimeError("attention module is already routed to harts_tree")
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    config = copy.copy(module.config)
    config._attn_implementation = TREE_ATTENTION_NAME
    # calls without a tree use the implementation the model's own config names at call time, so that
    # model.set_attn_implementation(...) takes effect while the model is patched
    handle._set(module, "_harts_attention_source", (module.config, eager))
    handle._set(module, "config", config)
    handle.attention_modules.append(module)


def _original_attention(module) -> Callable:
    """The attention function the module's model config names now (``eager`` included)."""
    source = getattr(module, "_harts_attention_source", None)
    if source is None:
        raise RuntimeError("harts_tree attention used on a module that apply_tree_patches did not patch")
    config, eager = source
    name = config._attn_implementation or "eager"
    if name == TREE_ATTENTION_NAME:
        raise RuntimeError(f"{type(module).__name__}: the model's config names {TREE_ATTENTION_NAME!r} attention, "
                           "which apply_tree_patches sets by itself; set_attn_implementation('sdpa') or 'eager'")
    return ALL_ATTENTION_FUNCTIONS.get_interface(name, eager)


def tree_attention_function(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The ``"harts_tree"`` attention function (transformers' AttentionInterface signature).

    With ``harts_tree`` metadata: ``query [1, HQ, U, D]``, ``key``/``value [1, HKV, U, D]`` attend along the
    tree (the ``attention_mask`` argument is ignored). Without: the module's original attention function.
    """
    tree: TreeMetadata | None = kwargs.get(TREE_KWARG)
    if tree is None and _IN_TREE_FORWARD.get():
        raise ValueError(
            f"{type(module).__module__}.{type(module).__qualname__} called transformers' attention function without "
            f"the {TREE_KWARG!r} keyword argument during a tree forward: its forward does not pass its keyword "
            "arguments on to the attention function, so harts_hf cannot run it on a prefix forest. Train it without "
            "trees (TreeGRPOConfig(use_tree=False)).")
    if tree is None:
        return _original_attention(module)(module, query, key, value, attention_mask, scaling=scaling,
                                           dropout=dropout, **kwargs)
    if dropout and module.training:
        raise ValueError(f"{type(module).__name__}: tree execution does not support attention dropout (got "
                         f"{dropout}); set disable_dropout=True in the trainer's config (TRL then zeroes every "
                         "dropout), or the model config's attention dropout (attention_dropout; attn_pdrop in GPT-2 "
                         "style configs) to 0.0, or call model.eval() for the tree forward.")
    window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
    if window is None:
        _check_no_declared_window(module)
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))
    if window is not None and tree.context is not None:
        raise ValueError(f"{type(module).__name__}: a sliding-window layer in a planner piece below a branch point "
                         "is not supported; raise tree_token_budget so that each tree runs as one piece")
    if query.shape[0] != 1 or query.shape[2] != tree.num_tokens:
        raise ValueError(f"tree attention expects one packed row of {tree.num_tokens} tokens, got query {tuple(query.shape)}")
    # under autocast, in its dtype before the kernel choice below (and before hand-off exports record keys)
    q, k, v = autocast_inputs(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1))
    context_k = context_v = None
    if tree.context is not None or tree.exports:
        layer = layer_key(module)
        if tree.context is not None:
            context_k, context_v = tree.context.get(layer, "key"), tree.context.get(layer, "value")
        if tree.exports:  # a child sees every ancestor: this forest's context rows and the path to its branch
            keys = k if context_k is None else torch.cat([k, context_k.to(k.dtype)])
            values = v if context_v is None else torch.cat([v, context_v.to(v.dtype)])
            for export in tree.exports:
                index = tree.export_index(export.branch_token, export.ancestor_tokens, tree.context_tokens)
                export.record((layer, "key"), keys[index])
                export.record((layer, "value"), values[index])
    backend = tree.attention_backend
    if backend == "auto" and not (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)):
        # CUDA half precision: tree_attention picks flash varlen or cuDNN per run; elsewhere a dense U x U mask
        # (and SDPA's U x U scores) only while they stay small
        backend = "sdpa" if tree.num_tokens <= _DENSE_MASK_TOKENS else "runs"
    layout = tree.varlen_layout() if backend != "sdpa" else None
    out = tree_attention(q, k, v, tree.packed.subtree_end, scaling=scaling,
                         mask=tree.attention_mask(window) if backend == "sdpa" else None, backend=backend,
                         layout=layout, context_k=context_k, context_v=context_v, window=window, softcap=softcap,
                         sinks=sinks)
    return out.unsqueeze(0), None


def _check_no_declared_window(module) -> None:
    """The tree honours a sliding window only as the ``sliding_window`` argument of the attention call; a layer that
    its config declares sliding (or chunked) but that passes no window would have the window in its attention mask
    alone, which tree execution replaces: it raises rather than attend to the whole path."""
    kinds, layer = getattr(module.config, "layer_types", None), getattr(module, "layer_idx", None)
    if not isinstance(kinds, (list, tuple)) or not isinstance(layer, int) or not 0 <= layer < len(kinds):
        return
    if kinds[layer] in ("sliding_attention", "chunked_attention"):
        raise ValueError(f"{type(module).__module__}.{type(module).__qualname__} (layer {layer}): the config declares "
                         f"it {kinds[layer]!r} but it passes no sliding_window to the attention function, so its window "
                         "lives in the attention mask, which harts_hf does not use on a prefix forest. Train it without "
                         "trees (TreeGRPOConfig(use_tree=False)).")


def layer_key(module) -> int:
    """The layer index that keys a mixer's hand-off tensors (transformers' ``layer_idx``)."""
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise ValueError(f"{type(module).__name__} has no layer_idx; planner hand-offs key their tensors by it")
    return layer


AttentionInterface.register(TREE_ATTENTION_NAME, tree_attention_function)
