"""TRL's GRPO loss as a sum over tokens, for microbatches that run as planner pieces (each its own backward).

``RowLayout`` maps TRL's ``(B, logits_to_keep)`` rows to the sequences of one prefix forest and back;
``token_level_loss`` is TRL 1.16's per-token loss (``GRPOTrainer._compute_loss``, token-level importance
sampling) and ``token_weights`` its normalisers, so that the loss of a microbatch is ``sum(weight * loss)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..trees import PrefixForest

__all__ = ["RowLayout", "TOKEN_LEVEL_LOSSES", "token_level_loss", "token_weights"]

TOKEN_LEVEL_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo")


@dataclass
class RowLayout:
    """The real tokens of TRL's padded rows as one prefix forest (sequence ``i`` is row ``i``).

    ``row_index`` / ``column_index`` (long, flat, row-major) are the padded places of every real token;
    ``completion_column [sum(len_i - 1)]`` (long) is, for every predicted token (positions 1.. of each
    sequence, flat, from ``starts[i]``), its column in the ``(B, logits_to_keep)`` layout, negative for prompt
    tokens; ``predicted_row`` is its row.
    """

    row_index: torch.Tensor
    column_index: torch.Tensor
    lengths: list[int]
    forest: PrefixForest
    completion_column: torch.Tensor
    predicted_row: torch.Tensor
    starts: torch.Tensor
    shape: tuple[int, int]

    @classmethod
    def of(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
           share_across_groups: bool) -> RowLayout:
        """``input_ids``/``attention_mask`` ``[B, W]``: TRL's prompt (left-padded) + completion columns."""
        rows, columns = attention_mask.bool().nonzero(as_tuple=True)  # row-major: each row's real tokens in order
        lengths = attention_mask.bool().sum(1).tolist()
        empty_rows = [i for i, n in enumerate(lengths) if n == 0]
        if empty_rows:
            raise ValueError(f"rows {empty_rows} of the batch have no tokens (attention_mask all 0)")
        tokens = input_ids[rows, columns].split(lengths)
        prompt_width = input_ids.shape[1] - logits_to_keep
        scored = (columns >= prompt_width).split(lengths)
        column_of = columns.split(lengths)
        groups = None
        if not share_across_groups:
            groups = [tuple(t[: int((c < prompt_width).sum())].tolist()) for t, c in zip(tokens, column_of)]
        forest = PrefixForest.from_sequences(list(tokens), loss_masks=list(scored), groups=groups)
        completion_column = torch.cat([c[1:] - prompt_width for c in column_of])
        predicted = torch.tensor([n - 1 for n in lengths], device=input_ids.device)
        predicted_row = torch.repeat_interleave(torch.arange(len(lengths), device=input_ids.device), predicted)
        starts = torch.cumsum(predicted, 0) - predicted
        return cls(rows, columns, lengths, forest, completion_column, predicted_row, starts,
                   (input_ids.shape[0], logits_to_keep))

    def columns(self, sequence: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """Column in ``(B, logits_to_keep)`` of the token predicted at ``position`` of ``sequence`` (< 0: prompt)."""
        return self.completion_column[self.starts[sequence] + position]

    def to_rows(self, per_sequence: list[torch.Tensor]) -> torch.Tensor:
        """``[len_i - 1]`` values per sequence -> ``(B, logits_to_keep)`` fp32, 0 at padding."""
        values = torch.cat(per_sequence).float()
        keep = self.completion_column >= 0
        out = values.new_zeros(self.shape)
        return out.index_put((self.predicted_row.to(values.device)[keep], self.completion_column[keep]), values[keep])


def token_weights(trainer, inputs: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    """TRL's normalisers as per-token weights ``(B, T)``: the microbatch's policy loss is
    ``sum(weight * per_token_loss)``, its entropy bonus ``sum(entropy_weight * entropy)`` (None without one).
    Train mode; the loss already carries TRL's ``1 / gradient_accumulation_steps``."""
    mask = inputs["completion_mask"].float()
    if "tool_mask" in inputs:
        mask = mask * inputs["tool_mask"]
    accumulation = trainer.current_gradient_accumulation_steps
    loss_type = trainer.loss_type
    if loss_type in ("grpo", "sapo"):
        weight = mask / (mask.sum(-1, keepdim=True).clamp(min=1.0) * mask.shape[0] * accumulation)
    elif loss_type == "bnpo":
        weight = mask / (mask.sum().clamp(min=1.0) * accumulation)
    elif loss_type == "dr_grpo":
        weight = mask / (mask.shape[0] * trainer.max_completion_length * accumulation)
    elif loss_type in ("dapo", "cispo"):
        normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / trainer.accelerator.num_processes
        normalizer = normalizer * accumulation / trainer.args.steps_per_generation
        weight = mask / normalizer
    else:
        raise ValueError(f"loss_type={loss_type!r} has no token-level form here; expected one of {TOKEN_LEVEL_LOSSES}")
    entropy_weight = None
    if trainer._entropy_bonus_enabled:
        if trainer.use_adaptive_entropy:
            coefficient = trainer.entropy_coef if trainer._last_world_entropy <= trainer.args.entropy_target else 0.0
        else:
            coefficient = trainer.entropy_coef
        entropy_weight = -coefficient * mask / (mask.sum().clamp(min=1.0) * accumulation)
    return weight, entropy_weight


def token_level_loss(trainer, logps: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor,
                     inputs: dict) -> torch.Tensor:
    """TRL's ``per_token_loss`` at the places ``(rows, columns)`` given their live log-probs ``logps [n]``
    (importance sampling per token, so each place's loss depends on its own log-prob only)."""
    def at(value):
        return value[rows, 0] if value.shape[1] == 1 else value[rows, columns]

    advantages = inputs["advantages"]
    advantages = at(advantages.unsqueeze(1) if advantages.dim() == 1 else advantages)
    old = inputs.get("old_per_token_logps")
    old = logps.detach() if old is None else at(old)
    coef_1 = torch.exp(logps - old)
    if trainer.beta != 0.0:
        ref = at(inputs["ref_per_token_logps"])
        per_token_kl = torch.exp(ref - logps) - (ref - logps) - 1
        if trainer.args.use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1
    if trainer.loss_type == "cispo":
        loss = -torch.clamp(coef_1, max=trainer.epsilon_high).detach() * advantages * logps
    elif trainer.loss_type in ("grpo", "bnpo", "dr_grpo", "dapo"):
        coef_2 = torch.clamp(coef_1, 1 - trainer.epsilon_low, 1 + trainer.epsilon_high)
        if trainer.args.delta is not None:
            coef_1 = torch.clamp(coef_1, max=trainer.args.delta)
        loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    elif trainer.loss_type == "sapo":
        temperatures = torch.where(advantages > 0, trainer.args.sapo_temperature_pos, trainer.args.sapo_temperature_neg)
        loss = -torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures * advantages
    else:
        raise ValueError(f"loss_type={trainer.loss_type!r} has no token-level form here; expected one of "
                         f"{TOKEN_LEVEL_LOSSES}")
    if trainer.use_vllm and trainer.vllm_importance_sampling_correction:
        loss = loss * at(inputs["importance_sampling_ratio"])
    if trainer.beta != 0.0:
        loss = loss + trainer.beta * per_token_kl
    return loss
