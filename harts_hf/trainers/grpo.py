"""TreeGRPOTrainer: TRL's GRPOTrainer with policy, old and reference log-probs from prefix-tree forwards.

Two TRL hooks change; everything else (generation, rewards, advantages, every loss type) is TRL's:
- ``_get_per_token_logps_and_entropies``: one tree forward per microbatch (or per token-budget slice),
  scattered back to TRL's ``(B, logits_to_keep)`` layout, so the loss code sees what it always sees;
- ``_prepare_inputs``: the generation batch is shuffled by prompt group, not by row, so siblings that
  share a prefix land in the same microbatch.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from transformers.utils import logging
from trl import GRPOTrainer
from trl.trainer.utils import split_pixel_values_by_grid, split_tensor_dict, unsplit_pixel_values_by_grid

from ..kernels import TreeMetadata
from ..logprobs import run_tree_forward, unwrap_model
from ..model_patches import apply_tree_patches
from ..model_patches.core import _PATCH_MARK
from ..model_patches.entry import load_balancing_loss
from ..planner.baselines import common_prefix_length
from ..trees import PrefixForest
from .config import TreeGRPOConfig

__all__ = ["TreeGRPOTrainer"]

logger = logging.get_logger(__name__)

_MULTIMODAL_KEYS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes", "num_tiles",
                    "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")


class TreeGRPOTrainer(GRPOTrainer):
    """Drop-in for :class:`trl.GRPOTrainer` (same arguments); pass a :class:`TreeGRPOConfig` as ``args``.

    On construction the policy (and reference) model is patched for tree execution
    (:func:`harts_hf.model_patches.apply_tree_patches`); ordinary forwards, such as generation, are unchanged.
    Unsupported model types raise with the list of supported ones; set ``use_tree=False`` to train them.
    """

    _tag_names = ["trl", "grpo", "harts_hf", "tree-grpo"]

    def __init__(self, model, reward_funcs, args: TreeGRPOConfig | None = None, **kwargs):
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = TreeGRPOConfig(f"{name.split('/')[-1]}-TreeGRPO")
        elif not isinstance(args, TreeGRPOConfig):
            raise TypeError(f"args is a {type(args).__name__}; TreeGRPOTrainer needs a TreeGRPOConfig "
                            "(it has every GRPOConfig field plus the tree switches).")
        super().__init__(model=model, reward_funcs=reward_funcs, args=args, **kwargs)
        self._tree_handles = []
        self._tree_metrics = defaultdict(list)
        if args.use_tree:
            for target in (self.model, self.ref_model):
                if target is None:
                    continue
                base = unwrap_model(target)
                if getattr(base, _PATCH_MARK, None) is None:
                    self._tree_handles.append(apply_tree_patches(base))

    # ------------------------------------------------------------------ log-probs
    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        """TRL hook, changed: the rows become one prefix forest (split by ``tree_token_budget``), computed in
        one forward per slice; results are laid out as TRL's ``(B, logits_to_keep)`` tensors. Multimodal
        batches and ``use_tree=False`` take TRL's path. ``batch_size`` (TRL's row chunking) is superseded by
        the token budget."""
        if not self.args.use_tree or any(multimodal.get(key) is not None for key in _MULTIMODAL_KEYS):
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **multimodal)
        base = unwrap_model(model)
        rows, columns = attention_mask.bool().nonzero(as_tuple=True)  # row-major: each row's real tokens in order
        lengths = attention_mask.bool().sum(1).tolist()
        tokens = input_ids[rows, columns].split(lengths)
        scored = (columns >= input_ids.shape[1] - logits_to_keep).split(lengths)
        column_of = columns.split(lengths)
        empty_rows = [i for i, n in enumerate(lengths) if n == 0]
        if empty_rows:
            raise ValueError(f"rows {empty_rows} of the batch have no tokens (attention_mask all 0)")
        groups = None
        if not self.args.tree_share_across_groups:
            prompt_length = input_ids.shape[1] - logits_to_keep
            groups = [tuple(t[: int((c < prompt_length).sum())].tolist()) for t, c in zip(tokens, column_of)]

        logps = input_ids.new_zeros(input_ids.shape, dtype=torch.float32)
        entropies = torch.zeros_like(logps) if compute_entropy else None
        router_logits, router_weights = [], []
        for slice_rows in self._token_budget_slices(tokens):
            forest = PrefixForest.from_sequences(
                [tokens[i] for i in slice_rows], loss_masks=[scored[i] for i in slice_rows],
                groups=None if groups is None else [groups[i] for i in slice_rows])
            with self.accelerator.autocast():
                tree, token_values, token_entropy, output = run_tree_forward(
                    model, forest, input_ids.device, only_loss_tokens=True, compute_entropy=compute_entropy,
                    temperature=self.temperature, aux_loss=compute_aux_loss, gdn_backend=self.args.tree_gdn_backend,
                    attention_backend=self.args.tree_attention_backend, float32_head=self.args.cast_lm_head_to_fp32,
                    chunk_size=self.args.tree_head_chunk_size)
            packed = tree.packed
            # per packed token -> per (row, column); the gather's backward sums shared tokens' gradients
            index_rows = torch.cat([torch.full((lengths[i],), i, device=input_ids.device) for i in slice_rows])
            index_columns = torch.cat([column_of[i] for i in slice_rows])
            logps = logps.index_put((index_rows, index_columns), token_values[packed.sequence_token_index])
            if compute_entropy:
                entropies = entropies.index_put((index_rows, index_columns), token_entropy[packed.sequence_token_index])
            if compute_aux_loss:
                router_logits.append(output.router_logits)
                router_weights.append(packed.multiplicity)
            if torch.is_grad_enabled():
                self._record_tree_stats(tree)
        aux_loss = None
        if compute_aux_loss:
            layers = [torch.cat([per_slice[layer] for per_slice in router_logits]) for layer in range(len(router_logits[0]))]
            aux_loss = load_balancing_loss(base, layers, torch.cat(router_weights))
        keep = slice(input_ids.shape[1] - logits_to_keep, None)
        return logps[:, keep], (entropies[:, keep] if compute_entropy else None), aux_loss

    def _token_budget_slices(self, tokens: list[torch.Tensor]) -> list[list[int]]:
        """Rows in depth-first (lexicographic) order, cut where the unique tokens of a slice would pass the budget.

        In sorted order, each row adds ``len - LCP(previous row)`` new unique tokens, so the budget is exact.
        """
        budget = self.args.tree_token_budget
        if budget is None:
            return [list(range(len(tokens)))]
        as_lists = [t.tolist() for t in tokens]
        order = sorted(range(len(tokens)), key=lambda i: as_lists[i])
        slices, current, unique, previous = [], [], 0, []
        for i in order:
            sequence = as_lists[i]
            added = len(sequence) - common_prefix_length(previous, sequence)
            if current and unique + added > budget:
                slices.append(current)
                current, unique, added = [], 0, len(sequence)
            if added > budget and not current:
                logger.warning_once(f"a sequence of {len(sequence)} tokens exceeds tree_token_budget={budget}; "
                                    "it runs alone in its own tree forward")
            current.append(i)
            unique += added
            previous = sequence
        slices.append(current)
        return slices

    _TREE_KEYS = ("path_tokens", "unique_tokens", "R_tok", "R_att", "gdn_rounds", "gdn_replay_tokens")

    def _record_tree_stats(self, tree: TreeMetadata) -> None:
        """Per training forward; summed over processes (every rank runs the same number of forwards)."""
        stats = tree.stats()
        values = torch.tensor([float(stats[key]) for key in self._TREE_KEYS], device=self.accelerator.device)
        if self.accelerator.num_processes > 1:
            values = self.accelerator.gather(values.unsqueeze(0)).view(-1, len(self._TREE_KEYS))
        for row in values.view(-1, len(self._TREE_KEYS)).tolist():
            for key, value in zip(self._TREE_KEYS, row):
                self._tree_metrics[key].append(value)

    # ------------------------------------------------------------------ batching
    def _prepare_inputs(self, generation_batch):
        """TRL hook, changed: with ``tree_keep_groups_together`` the generation batch is shuffled by prompt group
        (rows with the same prompt stay adjacent, in depth-first order) instead of row by row."""
        if not (self.args.use_tree and self.args.tree_keep_groups_together) or not self.model.training:
            return super()._prepare_inputs(generation_batch)
        generate_every = self.args.steps_per_generation * self.num_iterations
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            generation_batch = self._generate_and_score_completions(generation_batch)
            generation_batch = split_pixel_values_by_grid(generation_batch)
            generation_batch = _permute_rows(generation_batch, _group_permutation(generation_batch))
            batches = split_tensor_dict(generation_batch, self.args.steps_per_generation)
            self._buffered_inputs = [unsplit_pixel_values_by_grid(batch) for batch in batches]
        return self._buffered_inputs[self._step % self.args.steps_per_generation]

    # ------------------------------------------------------------------ logging
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self._tree_metrics:
            totals = {k: sum(v) for k, v in self._tree_metrics.items()}
            logs["tree/path_tokens"] = totals["path_tokens"]
            logs["tree/unique_tokens"] = totals["unique_tokens"]
            logs["tree/R_tok"] = totals["path_tokens"] / max(totals["unique_tokens"], 1)
            logs["tree/R_att"] = sum(self._tree_metrics["R_att"]) / len(self._tree_metrics["R_att"])
            logs["tree/rounds"] = totals["gdn_rounds"] / len(self._tree_metrics["gdn_rounds"])
            logs["tree/replay_tokens"] = totals["gdn_replay_tokens"]
            self._tree_metrics.clear()
        super().log(logs, start_time)


def _group_permutation(batch: dict) -> torch.Tensor:
    """A random order of prompt groups; inside a group, rows sorted by their token sequence (siblings adjacent)."""
    prompt_ids, prompt_mask = batch["prompt_ids"], batch["prompt_mask"].bool()
    completion_ids, completion_mask = batch["completion_ids"], batch["completion_mask"].bool()
    prompts = [tuple(ids[mask].tolist()) for ids, mask in zip(prompt_ids, prompt_mask)]
    completions = [tuple(ids[mask].tolist()) for ids, mask in zip(completion_ids, completion_mask)]
    groups: dict[tuple, list[int]] = {}
    for row, prompt in enumerate(prompts):
        groups.setdefault(prompt, []).append(row)
    members = list(groups.values())
    order = torch.randperm(len(members)).tolist()
    rows = [row for g in order for row in sorted(members[g], key=lambda r: completions[r])]
    return torch.tensor(rows, dtype=torch.long)


def _permute_rows(batch: dict, permutation: torch.Tensor) -> dict:
    """Apply one row permutation to every per-row value of a TRL batch dict (as TRL's shuffle does)."""
    def permute(value):
        if value is None or (isinstance(value, torch.Tensor) and value.ndim == 0):
            return value
        if isinstance(value, torch.Tensor):
            return value[permutation.to(value.device)]
        return [value[i] for i in permutation.tolist()]

    return {key: permute(value) for key, value in batch.items()}
