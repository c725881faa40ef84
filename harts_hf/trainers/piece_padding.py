"""Planner pieces under DeepSpeed: every process issues the engine's collectives equally often, in the same order.

A piece's backward through the DeepSpeed engine is a collective (ZeRO-2 reduce-scatters each backward's gradients;
ZeRO-3 also all-gathers parameters in every module forward and backward), and processes run different numbers of
pieces (their microbatches differ). :class:`PiecePadding` pads each process with filler passes over a 2-token
forest that change nothing, to the most any process runs. Shared by TreeGRPOTrainer and TreeSFTTrainer, which
define ``_execute_options()`` (the :func:`execute_plan` options of their tree forwards).
"""

from __future__ import annotations

import functools

import torch

from ..planner import Plan, plan
from ..planner.execute import execute_plan

__all__ = ["PiecePadding"]


class PiecePadding:
    """Mixin of a transformers Trainer subclass running planner pieces; counts its fillers in
    ``last_piece_padding``."""

    last_piece_padding = 0

    def _zero_stage(self) -> int | None:
        plugin = self.accelerator.state.deepspeed_plugin if self.is_deepspeed_enabled else None
        return getattr(plugin, "zero_stage", None)

    def _missing_passes(self, *counts: int) -> list[int]:
        """Per count, the most any process has minus this process's (a collective: every process calls it)."""
        values = torch.tensor(counts, device=self.accelerator.device)
        if self.accelerator.num_processes > 1:
            values = self.accelerator.gather(values).view(-1, len(counts)).amax(0)
        return [int(most) - count for most, count in zip(values.tolist(), counts)]

    def _pad_pieces(self, model, the_plan: Plan, backward) -> dict:
        """Filler passes so that every process issues DeepSpeed's collectives equally often and in the same order.
        ZeRO-2 reduces gradients in every engine backward: as many piece backwards everywhere (fillers first).
        ZeRO-3 also all-gathers parameters in every forward: pieces run in two phases (:func:`execute_plan`'s
        ``schedule='phased'``: hand-off forwards, then forward+backward pairs), each padded to the most any process
        runs. Returns the extra :func:`execute_plan` options."""
        pairs = len(the_plan.pieces) - 1  # the last pair is the Trainer's own backward, on every process
        if self._zero_stage() != 3:
            missing = self._missing_passes(pairs)[0]
            self._run_fillers(model, backwards=missing, backward=backward)
            return {}
        sources = len({p.handoff.source_piece for p in the_plan.pieces if p.handoff is not None})
        forwards, missing = self._missing_passes(sources, pairs)
        self._run_fillers(model, forwards=forwards)
        return dict(schedule="phased",
                    between_phases=functools.partial(self._run_fillers, model, backwards=missing, backward=backward))

    def _run_fillers(self, model, *, forwards: int = 0, backwards: int = 0, backward=None) -> None:
        """Passes over a 2-token forest that change nothing (the same modules in the same order as a piece's):
        ``forwards`` without gradient, ``backwards`` forward+backward pairs of a zero loss through ``backward``."""
        if not forwards and not backwards:
            return
        tokens = [0, 1]
        filler = plan([tokens], num_replicas=1, token_budget=len(tokens))
        with self.accelerator.autocast():
            for _ in range(forwards):
                execute_plan(model, filler, **self._execute_options())
            for _ in range(backwards):
                execute_plan(model, filler, logprob_weights=[torch.zeros(len(tokens) - 1)], backward=backward,
                             **self._execute_options())
        self.last_piece_padding += forwards + backwards
