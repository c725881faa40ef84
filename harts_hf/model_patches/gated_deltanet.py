"""Tree forward for gated-delta-rule mixers (Gated DeltaNet: Qwen3-Next, Qwen3.5; Kimi Delta Attention: Kimi
Linear): projections once per unique token, tree conv1d over ancestor windows, tree gated delta rule, then the
layer's own gated norm and output projection. Planner pieces take their root's conv window, state and replay rows
from a hand-off and export their own.

Families differ in how the input projections and gates are computed (each passes a ``project`` function) and in
their modules' names (a :class:`MixerLayout`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kernels import TreeMetadata, tree_causal_conv1d, tree_gated_delta_rule
from ..kernels._backend import in_row_blocks
from ..kernels.context import GDN_REPLAY_NAMES
from ..kernels.tree_conv1d import ops as conv_ops
from ..kernels.tree_gated_delta_rule.executed import executed_rows
from .core import TREE_KWARG, PatchedForward, layer_key, zero3_enabled

__all__ = ["EXECUTED_LAYOUT", "GATED_DELTANET", "MixerLayout", "executed_layout", "gdn_gates", "make_tree_gdn_forward",
           "tree_conv_with_handoffs", "tree_mixer_call", "tree_recurrence_with_handoffs"]

_CACHE_KWARGS = ("cache", "cache_params", "past_key_values", "past_key_value")


@dataclass(frozen=True)
class MixerLayout:
    """Where a family's mixer keeps its sizes and modules: attribute names of the q / k width (all heads), the v
    width, one key head's and one value head's dim, the gated output norm and the output projection."""

    key_dim: str = "key_dim"
    value_dim: str = "value_dim"
    head_k_dim: str = "head_k_dim"
    head_v_dim: str = "head_v_dim"
    norm: str = "norm"
    out_proj: str = "out_proj"


GATED_DELTANET = MixerLayout()  # Qwen3-Next and Qwen3.5's Gated DeltaNet


def gdn_gates(module, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated DeltaNet's write strength and log decay from its ``b``, ``a`` projections ``[U, HV]``:
    ``beta = sigmoid(b)``, ``g = -exp(A_log) * softplus(a + dt_bias)`` (in fp32), as transformers computes them."""
    return b.sigmoid(), -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)


def make_tree_gdn_forward(project: Callable, layout: MixerLayout = GATED_DELTANET) -> Callable:
    """Build a forward factory ``module -> {"forward": ...}`` for one family's gated-delta-rule mixers.

    ``project(module, x [1, U, hidden]) -> (mixed_qkv [U, conv_dim], z [U, HV, V], beta [U, HV], g)`` with ``g``
    the log decay, ``[U, HV]`` or per key channel ``[U, HV, K]`` (a module-level function: the forward pickles with
    its module). The forward is a :class:`~.core.PatchedForward` of the module, so a deep copy of a patched model
    patches the copy.
    """

    def factory(module: torch.nn.Module) -> dict:
        return {"forward": PatchedForward(module, module.forward, functools.partial(_gdn_call, project, layout))}

    return factory


def tree_mixer_call(tree_forward: Callable, module, original_forward, *args, **kwargs):
    """A recurrent mixer's patched call: its own forward without a ``harts_tree`` argument, else
    ``tree_forward(module, hidden_states [1, U, hidden], tree)`` (no cache; one packed row of the forest)."""
    tree = kwargs.pop(TREE_KWARG, None)
    if tree is None:
        return original_forward(*args, **kwargs)
    hidden_states = args[0] if args else kwargs["hidden_states"]
    if any(kwargs.get(name) is not None for name in _CACHE_KWARGS):
        raise ValueError("tree execution computes a whole forest in one pass and cannot use a cache; "
                         "call the model with use_cache=False")
    if hidden_states.shape[0] != 1 or hidden_states.shape[1] != tree.num_tokens:
        raise ValueError(f"tree execution expects one packed row of {tree.num_tokens} tokens, "
                         f"got hidden_states {tuple(hidden_states.shape)}")
    return tree_forward(module, hidden_states, tree)


def _gdn_call(project: Callable, layout: MixerLayout, module, original_forward, *args, **kwargs):
    forward = functools.partial(tree_gdn_forward, project=project, layout=layout)
    return tree_mixer_call(forward, module, original_forward, *args, **kwargs)


def tree_gdn_forward(module, hidden_states: torch.Tensor, tree: TreeMetadata, project: Callable,
                     layout: MixerLayout = GATED_DELTANET) -> torch.Tensor:
    """``hidden_states [1, U, hidden]`` -> ``[1, U, hidden]`` over the forest in ``tree``."""
    backend = tree.gdn_backend_for(hidden_states)
    plan = tree.gdn_plan(backend)
    rows = executed_layout(tree, plan)
    x = hidden_states if rows is None else rows.to_executed(hidden_states[0]).unsqueeze(0)
    mixed_qkv, z, beta, g = project(module, x)
    key_dim, value_dim, head_k_dim, head_v_dim = (getattr(module, getattr(layout, name))
                                                  for name in ("key_dim", "value_dim", "head_k_dim", "head_v_dim"))
    layer = layer_key(module) if tree.context is not None or tree.exports else None
    mixed_qkv = tree_conv_with_handoffs(module, tree, layer, mixed_qkv, rows)
    N = mixed_qkv.shape[0]
    query, key, value = torch.split(mixed_qkv, [key_dim, key_dim, value_dim], dim=-1)
    query = query.reshape(N, -1, head_k_dim)
    key = key.reshape(N, -1, head_k_dim)
    value = value.reshape(N, -1, head_v_dim)
    core = tree_recurrence_with_handoffs(tree, layer, (query, key, value, g, beta),
                                         plan if rows is None else plan.executed_view(), rows, backend=backend,
                                         use_qk_l2norm_in_kernel=True)
    # under ZeRO-3 a module call is a collective and the block count differs between processes: call the norm's
    # forward per block (its weight is an external parameter of this module, gathered once)
    norm = getattr(module, layout.norm)
    norm = norm.forward if zero3_enabled() else norm
    core = in_row_blocks(norm, core.reshape(-1, head_v_dim), z.reshape(-1, head_v_dim))
    out = getattr(module, layout.out_proj)(core.reshape(1, N, -1))
    return out if rows is None else rows.to_rows(out[0]).unsqueeze(0)


EXECUTED_LAYOUT = False
"""Run a recurrent mixer (Gated DeltaNet, KDA, Mamba-2) whole in its node's executed layout: the layer's hidden
states gathered into the rounds' order once, the projections, conv, node, norm and output projection on those rows
(replayed ancestors again), and the output rows gathered back once (:mod:`~harts_hf.kernels.tree_gated_delta_rule
.executed`), instead of the node gathering its q, k, v and gates in and its outputs and gradients out. Fewer bytes
moved (on Kimi's preset the hidden row is about a quarter of the node's inputs) for a few percent more rows through
the projections. A planner piece that starts below a branch point (hand-off context) keeps the packed layout; one
that hands off to pieces below it exports their rows from the executed ones. A kept node output
(:func:`~.checkpointing.keep_mixer_outputs`) then has a row per executed position, a few percent more than
:func:`~.checkpointing.mixer_output_bytes_per_token` counts per token. Off by default: on an H100 (full-size `tau`,
2026-12-07) the node's gathers it removes were about what the extra projection rows, the hidden rows' gathers and their
gradient sum added (Kimi-Linear 4.63 s either way, 2.4 GiB lower peak; Nemotron-H 2.82 against 2.75 s; the 2.3B
Qwen3-Next 5.76 against 5.72 s; BENCHMARKS.md, "Where the trees lose")."""


def executed_layout(tree: TreeMetadata, plan):
    """The :class:`~harts_hf.kernels.tree_gated_delta_rule.executed.ExecutedRows` a mixer runs on
    (:data:`EXECUTED_LAYOUT`, a forest without hand-off context: it may export to pieces below it), or None for the
    packed rows."""
    if not EXECUTED_LAYOUT or tree.context is not None:
        return None
    return executed_rows(plan)


def tree_conv_with_handoffs(module, tree: TreeMetadata, layer: int | None, x: torch.Tensor,
                            rows=None) -> torch.Tensor:
    """``module.conv1d`` (depthwise, causal) over every path of the forest for ``x [U, C]``, its activation
    ``module.activation``; a planner piece reads its root's last ``W - 1`` ancestor rows from the hand-off context
    and exports its own for the pieces below it (``layer``: the module's key; None without hand-offs). With ``rows``
    (:func:`executed_layout`), ``x`` holds the executed positions' rows ``[E, C]`` and so does the result."""
    weight = module.conv1d.weight.squeeze(1)  # [C, W]
    conv_context = None if tree.context is None else tree.context.get(layer, "conv")
    if tree.exports:
        _export_rows(tree, layer, {"conv": x}, {"conv": conv_context},
                     lambda export: min(weight.shape[1] - 1, export.ancestor_tokens), rows)
    if rows is not None:
        ancestors = tree.ancestors(weight.shape[1])
        return tree_causal_conv1d(x, weight, module.conv1d.bias, rows.ancestors(ancestors),
                                  activation=module.activation, fixups=rows.conv_fixups(ancestors),
                                  backend=conv_ops.bulk_backend(x))
    return tree_causal_conv1d(x, weight, module.conv1d.bias, tree.ancestors(weight.shape[1]),
                              activation=module.activation, context=conv_context,
                              fixups=tree.conv_fixups(weight.shape[1]), backend=conv_ops.bulk_backend(x))


def tree_recurrence_with_handoffs(tree: TreeMetadata, layer: int | None, inputs: tuple, plan, rows=None,
                                  **options):
    """:func:`tree_gated_delta_rule` of ``inputs = (q, k, v, g, beta)`` on ``plan``; a planner piece starts from its
    hand-off's state and replay rows and exports its own states and rows for the pieces below it (``layer``: the
    module's key; None without hand-offs). With ``rows`` (:func:`executed_layout`) the inputs are the executed
    positions' and ``plan`` the executed view. ``options``: the kernel's keyword arguments."""
    if layer is None:
        return tree_gated_delta_rule(*inputs, plan, **options)
    replay = None
    if tree.context is not None and plan.context_tokens:
        replay = {name: tree.context.get(layer, name) for name in GDN_REPLAY_NAMES}
    initial_state = None if tree.context is None else tree.context.get_optional(layer, "state")
    out, states = tree_gated_delta_rule(*inputs, plan, initial_state=initial_state,
                                        context=None if replay is None else tuple(replay.values()),
                                        output_requested_states=True, **options)
    for export, state in zip(tree.exports, states):
        if state is not None:
            export.record((layer, "state"), state)
    _export_rows(tree, layer, dict(zip(GDN_REPLAY_NAMES, inputs)), replay or dict.fromkeys(GDN_REPLAY_NAMES),
                 lambda export: export.ancestor_tokens % plan.chunk_size, rows)
    return out


def _export_rows(tree: TreeMetadata, layer: int, own: dict, context: dict, count, executed=None) -> None:
    """For every export, the last ``count(export)`` rows of its branch token's path from ``own`` ``[U, ...]``
    tensors continued upwards by the ``context`` rows (None: no context rows). With ``executed``
    (:func:`executed_layout`; no context rows then), ``own`` holds the executed positions' rows: each token's own
    position is read."""
    rows = {name: tensor if context[name] is None else torch.cat([tensor, context[name].to(tensor.dtype)])
            for name, tensor in own.items()}
    for export in tree.exports:
        if count(export) == 0:
            continue
        for name, tensor in own.items():
            index = tree.export_index(export.branch_token, count(export), rows[name].shape[0] - tensor.shape[0])
            if executed is not None:
                index = executed.own_position[index]
            export.record((layer, name), rows[name][index])
