"""Tree forward for Gated DeltaNet mixers (Qwen3-Next, Qwen3.5): projections once per unique token,
tree conv1d over ancestor windows, tree gated delta rule, then the layer's own gated norm and output.
Planner pieces take their root's conv window, state and replay rows from a hand-off and export their own.

Families differ only in how the input projections are laid out; each passes a ``project`` function.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..kernels import TreeMetadata, tree_causal_conv1d, tree_gated_delta_rule
from ..kernels._backend import in_row_blocks
from ..kernels.context import GDN_REPLAY_NAMES
from ..kernels.tree_conv1d import ops as conv_ops
from .core import TREE_KWARG, PatchedForward, layer_key, zero3_enabled

__all__ = ["make_tree_gdn_forward"]

_CACHE_KWARGS = ("cache", "cache_params", "past_key_values", "past_key_value")


def make_tree_gdn_forward(project: Callable) -> Callable:
    """Build a forward factory ``module -> {"forward": ...}`` for one family's Gated DeltaNet mixers.

    ``project(module, x [1, U, hidden]) -> (mixed_qkv [U, conv_dim], z [U, HV, V], b [U, HV], a [U, HV])`` (a
    module-level function: the forward pickles with its module). The forward is a
    :class:`~.core.PatchedForward` of the module, so a deep copy of a patched model patches the copy.
    """

    def factory(module: torch.nn.Module) -> dict:
        return {"forward": PatchedForward(module, module.forward, functools.partial(_gdn_call, project))}

    return factory


def _gdn_call(project: Callable, module, original_forward, *args, **kwargs):
    tree = kwargs.pop(TREE_KWARG, None)
    if tree is None:
        return original_forward(*args, **kwargs)
    hidden_states = args[0] if args else kwargs["hidden_states"]
    if any(kwargs.get(name) is not None for name in _CACHE_KWARGS):
        raise ValueError("tree execution computes a whole forest in one pass and cannot use a cache; "
                         "call the model with use_cache=False")
    return tree_gdn_forward(module, hidden_states, tree, project)


def tree_gdn_forward(module, hidden_states: torch.Tensor, tree: TreeMetadata, project: Callable) -> torch.Tensor:
    """``hidden_states [1, U, hidden]`` -> ``[1, U, hidden]`` over the forest in ``tree``."""
    if hidden_states.shape[0] != 1 or hidden_states.shape[1] != tree.num_tokens:
        raise ValueError(f"tree execution expects one packed row of {tree.num_tokens} tokens, "
                         f"got hidden_states {tuple(hidden_states.shape)}")
    mixed_qkv, z, b, a = project(module, hidden_states)
    weight = module.conv1d.weight.squeeze(1)  # [conv_dim, W]
    handoff = tree.context is not None or bool(tree.exports)
    layer = layer_key(module) if handoff else None
    conv_context = None if tree.context is None else tree.context.get(layer, "conv")
    if tree.exports:
        _export_rows(tree, layer, {"conv": mixed_qkv}, {"conv": conv_context},
                     lambda export: min(weight.shape[1] - 1, export.ancestor_tokens))
    mixed_qkv = tree_causal_conv1d(mixed_qkv, weight, module.conv1d.bias, tree.ancestors(weight.shape[1]),
                                   activation=module.activation, context=conv_context,
                                   fixups=tree.conv_fixups(weight.shape[1]),
                                   backend=conv_ops.bulk_backend(mixed_qkv))
    U = mixed_qkv.shape[0]
    query, key, value = torch.split(mixed_qkv, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    query = query.reshape(U, -1, module.head_k_dim)
    key = key.reshape(U, -1, module.head_k_dim)
    value = value.reshape(U, -1, module.head_v_dim)
    beta = b.sigmoid()
    g = -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)
    backend = tree.gdn_backend_for(query)
    plan = tree.gdn_plan(backend)
    if not handoff:
        core = tree_gated_delta_rule(query, key, value, g, beta, plan, use_qk_l2norm_in_kernel=True, backend=backend)
    else:
        own = dict(zip(GDN_REPLAY_NAMES, (query, key, value, g, beta)))
        replay = None
        if tree.context is not None and plan.context_tokens:
            replay = {name: tree.context.get(layer, name) for name in GDN_REPLAY_NAMES}
        initial_state = None if tree.context is None else tree.context.get_optional(layer, "state")
        core, states = tree_gated_delta_rule(
            query, key, value, g, beta, plan, use_qk_l2norm_in_kernel=True, backend=backend,
            initial_state=initial_state, context=None if replay is None else tuple(replay.values()),
            output_requested_states=True)
        for export, state in zip(tree.exports, states):
            if state is not None:
                export.record((layer, "state"), state)
        _export_rows(tree, layer, own, replay or dict.fromkeys(GDN_REPLAY_NAMES),
                     lambda export: export.ancestor_tokens % plan.chunk_size)
    # under ZeRO-3 a module call is a collective and the block count differs between processes: call the norm's
    # forward per block (its weight is an external parameter of this module, gathered once)
    norm = module.norm.forward if zero3_enabled() else module.norm
    core = in_row_blocks(norm, core.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
    return module.out_proj(core.reshape(1, U, -1))


def _export_rows(tree: TreeMetadata, layer: int, own: dict, context: dict, count) -> None:
    """For every export, the last ``count(export)`` rows of its branch token's path from ``own`` ``[U, ...]``
    tensors continued upwards by the ``context`` rows (None: no context rows)."""
    rows = {name: tensor if context[name] is None else torch.cat([tensor, context[name].to(tensor.dtype)])
            for name, tensor in own.items()}
    for export in tree.exports:
        if count(export) == 0:
            continue
        for name, tensor in own.items():
            index = tree.export_index(export.branch_token, count(export), rows[name].shape[0] - tensor.shape[0])
            export.record((layer, name), rows[name][index])
