"""A whole recurrent mixer in a plan's executed layout: its input rows gathered once, its output rows once.

The gated-delta-rule nodes (Gated DeltaNet, KDA, Mamba-2's scan) run every round's units back to back, each unit a
path segment that starts on the chunk grid and replays the ancestors between that boundary and its first own token
(:mod:`.plan`). Fed the forest's rows, a node gathers its inputs into that layout (q, k, v, the gates: on Kimi's
preset about 40 KB a row in bf16 and fp32) and its outputs and gradients back. :class:`ExecutedRows` moves the gather
to the mixer's input instead, the layer's hidden states (9 KB a row at Kimi's width in fp32), and the return to its
output: the projections, the conv, the node, the gated norm and the output projection then run on the executed rows
(the replayed ones again: 3% more rows on full-size `tau` at chunks of 64, 7% at Mamba-2's 128), the node on
:meth:`~.plan.GatedDeltaPlan.executed_view`, whose rows already are its layout.

Exact: a replayed row is its token's row again (the same inputs, so the same projections); the depthwise conv reads
each row's ancestors within its unit and, for a unit's first ``W - 1`` rows, the ancestors before the unit from their
own executed rows (:meth:`ExecutedRows.ancestors`); the gradient of the gathered hidden states sums each token's
copies in fp32 and rounds once (:func:`~.round_batch.sum_by_token`, deterministic), and only own rows carry the output's
gradient. Needs a forest without hand-off context rows (a planner piece below a branch point keeps the packed layout);
a piece that hands off to pieces below it exports their rows from each token's own position.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .plan import GatedDeltaPlan
from .round_batch import position_maps, sum_by_token

__all__ = ["ExecutedRows", "executed_rows"]


@dataclass
class ExecutedRows:
    """The maps between a plan's ``U`` rows and its ``E`` executed positions (round after round, replays included):
    ``token_index [E]`` (the row each position reads), ``own_position [U]`` (the position that outputs each row),
    the replayed positions (``replay_position``, ``replay_token``, ``replay_rows``, ``replay_slot``: as in
    :class:`~.round_batch.RoundBatch`) and ``unit_start [E]`` (the first position of each position's unit)."""

    token_index: torch.Tensor
    own_position: torch.Tensor
    replay_position: torch.Tensor
    replay_token: torch.Tensor
    replay_rows: torch.Tensor
    replay_slot: torch.Tensor
    unit_start: torch.Tensor
    identity: bool = False
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def num_positions(self) -> int:
        return self.token_index.shape[0]

    def to_executed(self, x: torch.Tensor) -> torch.Tensor:
        """``[E, ...]``: the rows of ``x [U, ...]`` at every executed position (differentiable; the backward sums a
        row's copies in fp32, rounded once). The identity layout (nothing replayed, every row at its own position: a
        forest of unshared sequences) returns ``x``."""
        return x if self.identity else _ToExecuted.apply(x, self)

    def to_rows(self, y: torch.Tensor) -> torch.Tensor:
        """``[U, ...]``: each row's own position of ``y [E, ...]`` (differentiable; replayed positions get zero
        gradient)."""
        return y if self.identity else _ToRows.apply(y, self)

    def ancestors(self, token_ancestors: torch.Tensor) -> torch.Tensor:
        """``[E, W]`` long: the conv's ancestor table over the executed positions, from the rows' own table
        ``token_ancestors [U, W]`` (column ``j``: the ``j``-th ancestor, -1 past a root; no context rows). Column ``j``
        of position ``p`` is ``p - j`` inside ``p``'s unit, else the own position of that ancestor (the unit's first
        ``W - 1`` positions reach before it). Cached per width."""
        width = token_ancestors.shape[1]
        key = ("ancestors", width)
        if key not in self._cache:
            if bool((token_ancestors >= self.own_position.shape[0]).any()):
                raise ValueError("ExecutedRows.ancestors: the ancestor table reads context rows; a forest with "
                                 "hand-off context keeps the packed layout")
            position = torch.arange(self.num_positions, device=self.token_index.device)
            depth_in_unit = (position - self.unit_start)[:, None]
            column = torch.arange(width, device=position.device)[None, :]
            inside = column <= depth_in_unit
            before = token_ancestors[self.token_index[self.unit_start][:, None], (column - depth_in_unit).clamp(min=0)]
            outside = torch.where(before >= 0, self.own_position[before.clamp(min=0)], -1)
            self._cache[key] = torch.where(inside, position[:, None] - column, outside)
        return self._cache[key]

    def conv_fixups(self, token_ancestors: torch.Tensor) -> torch.Tensor:
        """:func:`~harts_hf.kernels.tree_conv1d.ops.conv_window_fixups` of :meth:`ancestors`, cached (it syncs)."""
        from ..tree_conv1d.ops import conv_window_fixups

        width = token_ancestors.shape[1]
        key = ("fixups", width)
        if key not in self._cache:
            self._cache[key] = conv_window_fixups(self.ancestors(token_ancestors), width)
        return self._cache[key]


class _ToExecuted(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, rows: ExecutedRows):
        ctx.rows, ctx.num_rows = rows, x.shape[0]
        return x.index_select(0, rows.token_index)

    @staticmethod
    def backward(ctx, grad):
        return sum_by_token(ctx.rows, grad.contiguous(), ctx.num_rows), None


class _ToRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, rows: ExecutedRows):
        ctx.rows = rows
        return y.index_select(0, rows.own_position)

    @staticmethod
    def backward(ctx, grad):
        rows = ctx.rows
        full = grad.new_zeros(rows.num_positions, *grad.shape[1:])
        return full.index_copy_(0, rows.own_position, grad), None


def executed_rows(plan: GatedDeltaPlan) -> ExecutedRows:
    """The :class:`ExecutedRows` of ``plan`` on the plan's device, built once and cached on the plan."""
    cached = plan.__dict__.get("_executed_rows")
    if cached is not None:
        return cached
    if plan.context_tokens:
        raise ValueError("executed_rows: the plan replays hand-off context rows; a planner piece below a branch point "
                         "keeps the packed layout")
    device = plan.rounds[0].token_index.device if plan.rounds else torch.device("cpu")
    cpu = [round_.to("cpu") for round_ in plan.rounds]
    token_index, _, _, own_position, _, replay_position, replay_token, replay_rows, replay_slot = \
        position_maps(cpu, plan.num_tokens)
    starts, lengths, offset = [], [], 0
    for round_ in cpu:
        cu = round_.cu_seqlens.long()
        starts.append(cu[:-1] + offset)
        lengths.append(cu[1:] - cu[:-1])
        offset += int(cu[-1])
    unit_start = torch.repeat_interleave(torch.cat(starts), torch.cat(lengths)) if cpu else token_index
    identity = token_index.numel() == plan.num_tokens and torch.equal(token_index, torch.arange(plan.num_tokens))
    rows = ExecutedRows(*(t.to(device) for t in (token_index, own_position, replay_position, replay_token,
                                                   replay_rows, replay_slot, unit_start)), identity=identity)
    plan.__dict__["_executed_rows"] = rows
    return rows
