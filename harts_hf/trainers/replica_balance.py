"""Cross-process placement of whole prompt groups (TreeGRPOConfig.tree_balance_replicas).

TRL splits a generation batch over processes by position, so one process may hold far bigger trees than another
and a prompt group may straddle two processes. Here every process's part is gathered, whole groups are placed
with :func:`harts_hf.planner.assign_groups` (equal row counts, small largest tree cost), and each process keeps
its rows, padded as tightly as TRL pads them.
"""

from __future__ import annotations

import zlib

import torch

from ..planner import assign_groups, group_cost

__all__ = ["MULTIMODAL_KEYS", "balance_blocker", "batch_layout", "batch_signature", "gather_generation_batch",
           "place_groups", "prompt_groups", "select_rows", "widen"]

# How each key of TRL 1.16's generation batch (GRPOTrainer._generate_and_score_completions) is laid out:
# "left": (B, P) prompt columns, padding on the left; "right": (B, C) completion columns, padding on the right;
# "row": one value (or one (1,) row) per sequence; "global": already the same on every process.
_LAYOUT = {"prompt_ids": "left", "prompt_mask": "left", "completion_ids": "right", "completion_mask": "right",
           "old_per_token_logps": "right", "ref_per_token_logps": "right", "sampling_per_token_logps": "right",
           "tool_mask": "right", "advantages": "row", "num_items_in_batch": "global"}
# TRL's padding values where they matter to nobody but the reader (every padded place is masked out)
_PADDING = {"prompt_mask": 0, "completion_mask": 0, "tool_mask": 1, "importance_sampling_ratio": 1.0}
MULTIMODAL_KEYS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes", "num_tiles",
                   "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids", "num_images")


def balance_blocker(trainer) -> str | None:
    """Why moving rows between processes would change TRL's objective for this configuration, or None.

    With the same number of rows on every process (and so in every microbatch) the loss types whose normaliser is
    a per-row count or global ("grpo", "sapo", "luspo", "dr_grpo", "dapo", "cispo", "vespo") sum, under DDP's
    gradient average, to the same objective however rows are placed. Terms normalised by one microbatch's tokens
    or routing, or thresholded over one step's tokens, are not: their meaning would follow the placement.
    """
    if trainer.loss_type == "bnpo":
        return 'loss_type="bnpo" divides by the tokens of each microbatch'
    if trainer._entropy_bonus_enabled:
        return "the entropy bonus (entropy_coef / use_adaptive_entropy) is a mean over each microbatch's tokens"
    if trainer.aux_loss_enabled:
        return "the MoE load-balancing loss (router_aux_loss_coef) uses each microbatch's routing statistics"
    if trainer.top_entropy_quantile < 1.0:
        return "top_entropy_quantile < 1 takes its entropy threshold over the tokens of one step's microbatches"
    return None


def batch_layout(batch: dict, sequence_level_ratio: bool) -> dict[str, str]:
    """``key -> "left" | "right" | "row" | "global"`` for a generation batch; raises on keys it cannot place."""
    layout = {}
    for key, value in batch.items():
        if key == "importance_sampling_ratio":  # (B, 1) in vLLM's sequence modes, (B, C) in its token modes
            layout[key] = "row" if sequence_level_ratio else "right"
        elif key == "advantages" and isinstance(value, torch.Tensor) and value.ndim == 2:  # a subclass's (B, C)
            layout[key] = "right"
        elif key in _LAYOUT:
            layout[key] = _LAYOUT[key]
        else:
            raise ValueError(f"the generation batch holds {key!r}, which tree_balance_replicas does not know how to "
                             "move between processes; set tree_balance_replicas=False in the TreeGRPOConfig.")
        if layout[key] != "global" and not isinstance(value, torch.Tensor):
            raise ValueError(f"the generation batch's {key!r} is a {type(value).__name__}, not a tensor; "
                             "set tree_balance_replicas=False in the TreeGRPOConfig.")
    return layout


def widen(batch: dict, layout: dict[str, str], prompt_width: int, completion_width: int, pad_token_id: int) -> dict:
    """Pad prompt columns on the left to ``prompt_width`` and completion columns on the right to
    ``completion_width`` (token ids with ``pad_token_id``, masks with 0, ``tool_mask`` with 1)."""
    out = {}
    for key, value in batch.items():
        side = layout[key]
        if side in ("left", "right"):
            width = prompt_width if side == "left" else completion_width
            fill = pad_token_id if key.endswith("_ids") else _PADDING.get(key, 0)
            extra = value.new_full((value.shape[0], width - value.shape[1], *value.shape[2:]), fill)
            value = torch.cat([extra, value] if side == "left" else [value, extra], dim=1)
        out[key] = value
    return out


def select_rows(batch: dict, layout: dict[str, str], rows: list[int], pad_to_multiple_of: int | None = None) -> dict:
    """The ``rows`` of a (gathered) batch, without the columns that are padding in all of them (widths rounded up
    to ``pad_to_multiple_of`` as TRL rounds them)."""
    index = torch.tensor(rows, dtype=torch.long, device=batch["prompt_ids"].device)
    prompt_used = batch["prompt_mask"][index].bool().any(0)
    completion_used = batch["completion_mask"][index].bool().any(0)
    prompt_width = _rounded(prompt_used.numel() - int(prompt_used.long().argmax()) if prompt_used.any() else 0,
                            pad_to_multiple_of, prompt_used.numel())
    last = completion_used.numel() - int(completion_used.flip(0).long().argmax()) if completion_used.any() else 0
    completion_width = _rounded(last, pad_to_multiple_of, completion_used.numel())
    out = {}
    for key, value in batch.items():
        side = layout[key]
        if side == "global":
            out[key] = value
            continue
        value = value[index.to(value.device)]
        if side == "left":
            value = value[:, value.shape[1] - prompt_width:]
        elif side == "right":
            value = value[:, :completion_width]
        out[key] = value
    return out


def _rounded(width: int, multiple: int | None, limit: int) -> int:
    if multiple:
        width = -(-width // multiple) * multiple
    return min(width, limit)


def prompt_groups(batch: dict) -> list[list[int]]:
    """Rows with identical prompt tokens, groups in the order of their first row."""
    groups: dict[tuple, list[int]] = {}
    for row, (ids, mask) in enumerate(zip(batch["prompt_ids"], batch["prompt_mask"].bool())):
        groups.setdefault(tuple(ids[mask].tolist()), []).append(row)
    return list(groups.values())


def _sequences(batch: dict, rows: list[int]) -> list[torch.Tensor]:
    """Each row's real tokens (prompt then completion)."""
    out = []
    for row in rows:
        prompt = batch["prompt_ids"][row][batch["prompt_mask"][row].bool()]
        completion = batch["completion_ids"][row][batch["completion_mask"][row].bool()]
        out.append(torch.cat([prompt, completion]))
    return out


def place_groups(batch: dict, num_replicas: int, cost_model=None) -> dict:
    """Whole prompt groups of a gathered batch (``num_replicas`` equal parts in process order) on replicas.

    Returns ``rows`` (each replica's rows, or None when no equal-row placement of whole groups exists), the
    estimated ``loads_before`` (TRL's positional split) and ``loads_after``, and ``moved_rows``.
    """
    batch = {key: batch[key].cpu() for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}
    groups = prompt_groups(batch)
    num_rows = batch["prompt_ids"].shape[0]
    per_replica = num_rows // num_replicas
    costs = [group_cost(_sequences(batch, rows), cost_model) for rows in groups]
    loads_before = [0.0] * num_replicas
    initial = []
    for group, rows in enumerate(groups):  # TRL's split: a group straddling processes is two smaller forests
        parts: dict[int, list[int]] = {}
        for row in rows:
            parts.setdefault(row // per_replica, []).append(row)
        for replica, part in parts.items():
            loads_before[replica] += costs[group] if len(parts) == 1 else group_cost(_sequences(batch, part), cost_model)
        initial.append(next(iter(parts)) if len(parts) == 1 else None)
    replica_of = assign_groups([len(rows) for rows in groups], costs, num_replicas,
                               initial=None if None in initial else initial)
    if replica_of is None:
        return dict(rows=None, loads_before=loads_before, loads_after=loads_before, moved_rows=0)
    placed: list[list[int]] = [[] for _ in range(num_replicas)]
    for group, rows in enumerate(groups):
        placed[replica_of[group]].extend(rows)
    loads_after = [0.0] * num_replicas
    for group, replica in enumerate(replica_of):
        loads_after[replica] += costs[group]
    moved = sum(row // per_replica != replica for replica, rows in enumerate(placed) for row in rows)
    return dict(rows=placed, loads_before=loads_before, loads_after=loads_after, moved_rows=moved)


def gather_generation_batch(accelerator, batch: dict, layout: dict[str, str], pad_token_id: int) -> dict:
    """Every process's generation batch, concatenated in process order (TRL's global row order); prompt and
    completion columns padded to the widest process first. Every process must call it (collectives)."""
    widths = torch.tensor([[batch["prompt_ids"].shape[1], batch["completion_ids"].shape[1]]],
                          device=accelerator.device)
    prompt_width, completion_width = accelerator.gather(widths).max(0).values.tolist()
    wide = widen(batch, layout, prompt_width, completion_width, pad_token_id)
    return {key: value if layout[key] == "global" else accelerator.gather(value.contiguous())
            for key, value in sorted(wide.items())}


def batch_signature(batch: dict) -> tuple[int, int]:
    """(rows, checksum of the sorted key names): must agree on every process before any per-key collective."""
    keys = ",".join(sorted(batch)).encode()
    return batch["prompt_ids"].shape[0], zlib.crc32(keys)
