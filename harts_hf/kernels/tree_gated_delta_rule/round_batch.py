"""The executed layout of a gated-delta-rule plan's rounds for the round-batched fla nodes (Gated DeltaNet, KDA,
Mamba-2): every round's units back to back in one varlen grid, the gathers into and out of it, and the bank the
states handed between rounds live in. Host-built once per plan and device (:func:`round_batch`); pure torch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .plan import CONTEXT_STATE, GatedDeltaPlan

__all__ = ["RoundBatch", "position_maps", "round_batch", "sum_by_token"]


@dataclass
class RoundBatch:
    """All rounds' executed tokens back to back, round after round (host-built, then moved once).

    ``token_index [E]``, ``cu_seqlens [N + 1]`` and ``chunk_indices [NT, 2]`` describe every unit of every round as
    one varlen batch; ``output_position`` / ``output_token`` place the units' own outputs, and the same map as
    gathers: ``own_position [U]`` (each token's own executed position), ``position_token [E]`` (the token a position
    outputs, 0 at a replayed one), ``replay_position`` / ``replay_token`` (the positions that only replay a token:
    its gradient's other terms). Per round ``r``:
    ``tokens[r]`` / ``chunks[r]`` slice that round's executed tokens and chunks out of the batch, and
    ``round_cu[r]``, ``round_chunk_indices[r]``, ``round_chunk_offsets[r]`` are the round's own varlen grid.
    ``replay_rows`` are the distinct replayed tokens and ``replay_slot`` each replayed position's row among them.

    States handed between rounds live in a bank of ``num_states`` rows (row 0: zeros, never written): unit ``i`` of
    round ``r`` starts from row ``initial_ids[r][i]``; after the round, unit ``save_slots[r][j]``'s final state is
    stored in row ``save_ids[r][j]``; ``requested_ids`` are the plan's requested states' rows and ``context_id``
    the row of the handed-in state (or None). One gather and one scatter per round, whatever its unit count."""

    token_index: torch.Tensor
    cu_seqlens: torch.Tensor
    chunk_indices: torch.Tensor
    output_position: torch.Tensor
    output_token: torch.Tensor
    tokens: list
    chunks: list
    round_cu: list
    round_chunk_indices: list
    round_chunk_offsets: list
    num_states: int
    initial_ids: list
    save_ids: list
    save_slots: list
    requested_ids: torch.Tensor
    context_id: int | None
    own_position: torch.Tensor
    position_token: torch.Tensor
    replay_position: torch.Tensor
    replay_token: torch.Tensor
    replay_rows: torch.Tensor
    replay_slot: torch.Tensor
    identity: bool = False
    """Every token executed once, at its own row (a forest of unshared sequences, as the packed per-trajectory path
    runs): the gathers into and out of the executed layout are then views."""
    own_index: torch.Tensor | None = None
    """``token_index`` with the positions that read a context row (index ``>= U``) sent to row 0: with
    ``context_position`` / ``context_row`` (those positions, and their rows among the context rows), the executed
    layout gathered from the tokens' rows and the context rows apart (:meth:`executed`), never concatenated."""
    context_position: torch.Tensor | None = None
    context_row: torch.Tensor | None = None

    def to(self, device) -> RoundBatch:
        move = lambda items: [t.to(device) for t in items]  # noqa: E731
        return RoundBatch(self.token_index.to(device), self.cu_seqlens.to(device), self.chunk_indices.to(device),
                          self.output_position.to(device), self.output_token.to(device), self.tokens, self.chunks,
                          move(self.round_cu), move(self.round_chunk_indices), move(self.round_chunk_offsets),
                          self.num_states, move(self.initial_ids), move(self.save_ids), move(self.save_slots),
                          self.requested_ids.to(device), self.context_id, *move(
                              [self.own_position, self.position_token, self.replay_position, self.replay_token,
                               self.replay_rows, self.replay_slot]), self.identity,
                          *move([self.own_index, self.context_position, self.context_row]))

    def executed(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        """``[1, E, ...]``: the rows of ``x [rows, ...]`` at every executed position; with ``context``, ``x`` holds the
        ``U`` tokens' rows and ``context`` the plan's context rows (a planner piece's replay rows, read in place)."""
        if context is not None:
            out = x.index_select(0, self.own_index)
            out.index_copy_(0, self.context_position, context.index_select(0, self.context_row).to(x.dtype))
            return out.unsqueeze(0)
        if self.identity:
            return x[:self.own_position.shape[0]].contiguous().unsqueeze(0)
        return x[self.token_index].unsqueeze(0)

    def own_outputs(self, o: torch.Tensor) -> torch.Tensor:
        """``[U, ...]``: each token's output from ``o [E, ...]`` (its own executed position)."""
        return o if self.identity else o.index_select(0, self.own_position)

    def executed_grad(self, d_out: torch.Tensor) -> torch.Tensor:
        """``[1, E, ...]``: the output gradient ``d_out [U, ...]`` at every executed position, zero at the replayed
        ones (they output nothing)."""
        do = d_out.contiguous() if self.identity else d_out.index_select(0, self.position_token)
        if self.replay_position.numel():
            do.index_fill_(0, self.replay_position, 0)
        return do.unsqueeze(0)

    def bank_grad(self, bank: torch.Tensor, d_requested: torch.Tensor | None) -> torch.Tensor:
        """The gradient flowing into every row of a state bank like ``bank``, to start the backward from: the
        requested states' (the units that started from a row add theirs round by round, in reverse)."""
        d_bank = torch.zeros_like(bank)
        if d_requested is not None and self.requested_ids.numel():
            d_bank.index_add_(0, self.requested_ids, d_requested.float())
        return d_bank

    def sum_by_token(self, grad: torch.Tensor, rows: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``[rows, ...]``: the gradient of every input row from ``grad [E, ...]`` over the executed positions,
        its own position gathered plus its replayed positions added (rows past U are handed-in context rows, which
        only replays read). One gather and a small scatter instead of a full-size atomic scatter into zeros.
        ``dtype`` (default ``grad``'s): the result's; a low-precision result is summed in fp32 at the replayed rows
        only and rounded once there, so no fp32 copy of the whole gradient is made."""
        return sum_by_token(self, grad, rows, dtype)


def sum_by_token(layout, grad: torch.Tensor, rows: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """:meth:`RoundBatch.sum_by_token` for any ``layout`` with its executed-position maps (``own_position``,
    ``identity``, ``replay_position``, ``replay_token``, ``replay_rows``, ``replay_slot``): a :class:`RoundBatch`
    or an :class:`~.executed.ExecutedRows`."""
    work = grad.dtype if dtype is None else torch.promote_types(grad.dtype, dtype)
    U = layout.own_position.shape[0]
    if rows == U:  # the identity layout has no replayed position: the gradient is already in row order
        total = (grad[:U] if layout.identity else grad.index_select(0, layout.own_position)).to(work)
    else:  # context rows below the tokens' (a planner piece): written in place, not concatenated (a full copy)
        total = torch.empty(rows, *grad.shape[1:], dtype=work, device=grad.device)
        if layout.identity:
            total[:U].copy_(grad[:U])
        elif work == grad.dtype:
            torch.index_select(grad, 0, layout.own_position, out=total[:U])
        else:
            total[:U].copy_(grad.index_select(0, layout.own_position))
        total[U:].zero_()
    if layout.replay_position.numel():
        replayed = grad.index_select(0, layout.replay_position)
        if work.itemsize >= 4:
            total.index_add_(0, layout.replay_token, replayed.to(work))
        else:
            sums = total.index_select(0, layout.replay_rows).float()
            sums.index_add_(0, layout.replay_slot, replayed.float())
            total.index_copy_(0, layout.replay_rows, sums.to(work))
    return total if dtype is None else total.to(dtype)


def position_maps(rounds: list, num_tokens: int) -> tuple:
    """The maps between a plan's executed positions (its ``rounds``, on the CPU, back to back) and its
    ``num_tokens`` rows: ``token_index [E]``, ``output_position`` / ``output_token`` (the units' own outputs),
    ``own_position [U]``, ``position_token [E]`` (0 at a replayed position), ``replay_position`` / ``replay_token``
    and ``replay_rows`` / ``replay_slot`` (the distinct replayed rows, each replayed position's slot among them)."""
    offsets = [0]
    for round_ in rounds:
        offsets.append(offsets[-1] + round_.token_index.shape[0])
    token_index = torch.cat([r.token_index for r in rounds]).long()
    output_position = torch.cat([r.output_position + offset for r, offset in zip(rounds, offsets)]).long()
    output_token = torch.cat([r.output_token for r in rounds]).long()
    own_position = torch.full((num_tokens,), -1, dtype=torch.long)
    own_position[output_token] = output_position
    if output_token.numel() != num_tokens or bool((own_position < 0).any()):
        raise AssertionError("the plan's units must output every token exactly once")
    position_token = torch.zeros(token_index.shape[0], dtype=torch.long)
    position_token[output_position] = output_token
    replayed = torch.ones(token_index.shape[0], dtype=torch.bool)
    replayed[output_position] = False
    replay_position = torch.nonzero(replayed)[:, 0]
    replay_token = token_index[replay_position]
    replay_rows, replay_slot = torch.unique(replay_token, return_inverse=True)
    return (token_index, output_position, output_token, own_position, position_token, replay_position, replay_token,
            replay_rows, replay_slot)


def round_batch(plan: GatedDeltaPlan, device=None) -> RoundBatch:
    """The :class:`RoundBatch` of ``plan`` on ``device`` (default: the plan's), built once per plan and device and
    cached on the plan (every layer of a forward shares it)."""
    if device is None:
        device = plan.rounds[0].token_index.device if plan.rounds else torch.device("cpu")
    cache = plan.__dict__.setdefault("_round_batches", {})
    if str(device) in cache:
        return cache[str(device)]
    cpu = [round_.to("cpu") for round_ in plan.rounds]
    token_offset = unit_offset = chunk_offset = 0
    cu, chunk_indices, tokens, chunks = [torch.zeros(1, dtype=torch.long)], [], [], []
    round_cu, round_chunk_indices, round_chunk_offsets = [], [], []
    for round_ in cpu:
        lengths = (round_.cu_seqlens[1:] - round_.cu_seqlens[:-1]).long()
        counts = (lengths + plan.chunk_size - 1) // plan.chunk_size
        executed, num_chunks = int(round_.cu_seqlens[-1]), int(counts.sum())
        cu.append(round_.cu_seqlens[1:].long() + token_offset)
        chunk_indices.append(round_.chunk_indices + torch.tensor([unit_offset, 0]))
        tokens.append(slice(token_offset, token_offset + executed))
        chunks.append(slice(chunk_offset, chunk_offset + num_chunks))
        round_cu.append(round_.cu_seqlens.long())
        round_chunk_indices.append(round_.chunk_indices)
        round_chunk_offsets.append(torch.nn.functional.pad(counts.cumsum(0), (1, 0)))
        token_offset, unit_offset, chunk_offset = token_offset + executed, unit_offset + round_.num_units, \
            chunk_offset + num_chunks
    row_of: dict = {None: 0}  # state key -> bank row; row 0 stays zero
    if any(key == CONTEXT_STATE for round_ in cpu for key in round_.initial_state):
        row_of[CONTEXT_STATE] = len(row_of)
    for round_ in cpu:
        for _, chunks_done, key in round_.saved_states:
            if chunks_done is not None:
                raise ValueError("the fla backend needs a plan built with final_states_only=True")
            row_of.setdefault(key, len(row_of))
    rows = lambda keys: torch.tensor([row_of[key] for key in keys], dtype=torch.long)  # noqa: E731
    token_index, output_position, output_token, own_position, position_token, replay_position, replay_token, \
        replay_rows, replay_slot = position_maps(cpu, plan.num_tokens)
    context_position = torch.nonzero(token_index >= plan.num_tokens)[:, 0]
    own_index = token_index.clone()
    own_index[context_position] = 0
    batch = RoundBatch(token_index, torch.cat(cu), torch.cat(chunk_indices), output_position, output_token, tokens,
                       chunks, round_cu, round_chunk_indices, round_chunk_offsets, len(row_of),
                       [rows(r.initial_state) for r in cpu], [rows([key for _, _, key in r.saved_states]) for r in cpu],
                       [torch.tensor([slot for slot, _, _ in r.saved_states], dtype=torch.long) for r in cpu],
                       rows(plan.requested_states), row_of.get(CONTEXT_STATE), own_position, position_token,
                       replay_position, replay_token, replay_rows, replay_slot,
                       identity=token_index.numel() == plan.num_tokens
                       and torch.equal(token_index, torch.arange(plan.num_tokens))
                       and torch.equal(own_position, token_index),
                       own_index=own_index, context_position=context_position,
                       context_row=token_index[context_position] - plan.num_tokens)
    cache[str(device)] = batch = batch.to(device)
    return batch
