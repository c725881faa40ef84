"""TreeGRPOTrainer: TRL's GRPOTrainer with policy, old and reference log-probs from prefix-tree forwards.

Three TRL hooks change; everything else (generation, rewards, advantages, every loss type) is TRL's:
- ``_get_per_token_logps_and_entropies``: one tree forward per microbatch, scattered back to TRL's
  ``(B, logits_to_keep)`` layout, so the loss code sees what it always sees;
- ``compute_loss``: a microbatch larger than ``tree_token_budget`` runs as planner pieces, each its own
  forward + backward (TRL's loss per token, TRL's code for the value and metrics);
- ``_prepare_inputs``: the generation batch is shuffled by prompt group, not by row, so siblings that
  share a prefix land in the same microbatch; with several processes, whole groups are first placed on
  processes by tree cost (equal row counts; ``tree_balance_replicas``).
"""

from __future__ import annotations

import functools
import os
from collections import defaultdict

import torch
from transformers.utils import logging
from trl import GRPOTrainer
from trl.trainer.utils import split_pixel_values_by_grid, split_tensor_dict, unsplit_pixel_values_by_grid

from .. import planner  # planner.plan looked up per call, as the trainers always did
from .._checks import trainer_args
from ..logprobs import run_tree_forward, unwrap_model
from ..model_patches import apply_tree_patches, chunk_grid, cpu_safe, keep_attention_outputs
from ..model_patches.core import _PATCH_MARK
from ..model_patches.entry import load_balancing_loss
from ..planner import CostModel, Plan, imbalance
from ..planner.execute import PieceLogprobs, backward_surrogate, engine_backward, execute_plan, lead_forward
from .config import (
    TreeGRPOConfig,
    apply_layer_counts,
    apply_process_settings,
    check_dropout,
    check_planner_supported,
)
from .piece_loss import TOKEN_LEVEL_LOSSES, RowLayout, token_level_loss, token_weights
from .piece_padding import PiecePadding
from .replica_balance import (
    MULTIMODAL_KEYS,
    balance_blocker,
    batch_layout,
    batch_signature,
    gather_generation_batch,
    place_groups,
    prompt_groups,
    select_rows,
)

__all__ = ["TreeGRPOTrainer"]

logger = logging.get_logger(__name__)


def out_of_memory_note(args, unallocated_gib: float | None = None) -> str:
    """What to change when a tree step runs out of GPU memory (added to the error); ``args``: the TreeGRPOConfig;
    ``unallocated_gib``: memory PyTorch's allocator held reserved but not allocated when it failed (fragmentation;
    :func:`unallocated_cuda_gib`)."""
    budget = args.tree_token_budget
    now = ("each microbatch's whole forest in one piece (tree_token_budget=None)" if budget is None else
           f"planner pieces of at most tree_token_budget={budget} unique tokens")
    fixes = ["set tree_token_budget (32768, say)" if budget is None else f"lower tree_token_budget below {budget}"]
    for field in ("tree_stored_layers", "tree_keep_matmul_layers", "tree_keep_matmul_gib", "tree_keep_mixer_gib"):
        if getattr(args, field, None):
            fixes.append(f"lower {field} (now {getattr(args, field)})")
    if getattr(args, "tree_keep_mixer_outputs", False):
        fixes.append("set tree_keep_mixer_outputs=False (its kept node outputs: mixer_output_bytes_per_token(model) "
                     "per token)")
    note = (f"harts_hf: a TreeGRPOTrainer step ran out of GPU memory with {now}; a piece's activations grow with its "
            f"tokens. To fit: {'; '.join(fixes)}; or shard the optimizer (DeepSpeed ZeRO). AdamW's two fp32 moments "
            "(8 bytes per trained parameter) arrive at the first optimizer step, so a second step can fail where the "
            "first fit.")
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get("PYTORCH_ALLOC_CONF", "")
    if unallocated_gib is not None and unallocated_gib >= 2 and "expandable_segments:True" not in conf:
        note += (f" {unallocated_gib:.1f} GiB were reserved by PyTorch's allocator but not allocated (fragmentation): "
                 "start the process with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (on an 80 GB H100 this let "
                 "a Kimi-Linear-shaped forest run whole where 49,152-token pieces had failed, 2026-12-06).")
    return note


def unallocated_cuda_gib() -> float | None:
    """GiB PyTorch's CUDA allocator holds reserved but not allocated on the current device (None without CUDA)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return (torch.cuda.memory_reserved() - torch.cuda.memory_allocated()) / 2**30


class TreeGRPOTrainer(PiecePadding, GRPOTrainer):
    """Drop-in for :class:`trl.GRPOTrainer` (same arguments); pass a :class:`TreeGRPOConfig` as ``args``.

    On construction the policy (and reference) model is patched for tree execution
    (:func:`harts_hf.model_patches.apply_tree_patches`); ordinary forwards, such as generation, are unchanged.
    Unsupported model types raise with the list of supported ones; set ``use_tree=False`` to train them.
    """

    _tag_names = ["trl", "grpo", "harts_hf", "tree-grpo"]

    def __init__(self, model, reward_funcs=None, args: TreeGRPOConfig | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, reward_processing_classes=None, callbacks=None,
                 optimizers=(None, None), quantization_config=None, peft_config=None, tools=None, rollout_func=None,
                 environment_factory=None):
        args = trainer_args(args, TreeGRPOConfig, model, "TreeGRPOTrainer", "GRPOConfig")
        super().__init__(model=model, reward_funcs=reward_funcs, args=args, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class,
                         reward_processing_classes=reward_processing_classes, callbacks=callbacks,
                         optimizers=optimizers, quantization_config=quantization_config, peft_config=peft_config,
                         tools=tools, rollout_func=rollout_func, environment_factory=environment_factory)
        self._tree_handles = []
        self._tree_metrics = defaultdict(list)
        self._balance_metrics = defaultdict(list)  # per generation batch; the same on every process
        self._replay = None  # (logps, entropies, tree stats) of planner pieces, for TRL's loss code
        self._layout_cache = None
        self.last_plan_memory: list = []  # execute_plan's CUDA allocator trace of the last planner microbatch
        self.last_piece_padding = 0  # DeepSpeed: filler passes run by this process in the last planner microbatch
        self._cost_model = CostModel.load(args.tree_cost_model) if args.tree_cost_model else None
        if args.use_tree and args.tree_token_budget is not None:
            self._check_planner_supported()
        if args.use_tree and args.tree_cross_replica_handoffs:
            self._check_cross_replica_supported()
        for target in (self.model, self.ref_model):
            if target is None:
                continue
            base = unwrap_model(target)
            if not args.use_tree:  # TRL's path; still no CPU tensor reaches a Triton kernel
                self._tree_handles.append(cpu_safe(base))
            elif getattr(base, _PATCH_MARK, None) is None:
                self._tree_handles.append(apply_tree_patches(base))
        if args.use_tree:
            check_dropout(unwrap_model(self.model), "TreeGRPOTrainer", logger,
                          "Set disable_dropout=True in TreeGRPOConfig (TRL then zeroes every dropout module)")
            apply_process_settings(args)
            if args.tree_keep_attention_outputs:
                keep_attention_outputs(unwrap_model(self.model))
        apply_layer_counts(unwrap_model(self.model), args, logger)
        self._chunk_grid = chunk_grid(unwrap_model(self.model))  # where the planner may cut inside a run

    # ------------------------------------------------------------------ log-probs
    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        """TRL hook, changed: the rows become one prefix forest computed in one tree forward; results are laid out
        as TRL's ``(B, logits_to_keep)`` tensors. A forest larger than ``tree_token_budget`` runs as planner pieces
        (forward-only here; with gradients :meth:`compute_loss` runs them). Multimodal batches and
        ``use_tree=False`` take TRL's path. ``batch_size`` (TRL's row chunking) is superseded by the budget."""
        if self._replay is not None:  # compute_loss already ran the pieces: hand their values to TRL's loss code
            logps, entropies, stats = self._replay
            self._replay = None
            self._record_tree_stats(stats)
            return logps, (entropies if compute_entropy else None), None
        if not self.args.use_tree or any(multimodal.get(key) is not None for key in MULTIMODAL_KEYS):
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **multimodal)
        layout = self._row_layout(input_ids, attention_mask, logits_to_keep)
        the_plan = None if self._fits_budget(layout) else self._plan(layout)
        filler_forwards = 0
        if not torch.is_grad_enabled() and self._zero_stage() == 3 and self.args.tree_token_budget is not None:
            # ZeRO-3 all-gathers parameters in every forward: as many forwards on every process
            filler_forwards = self._missing_passes(1 if the_plan is None else len(the_plan.pieces))[0]
        if the_plan is not None:
            if torch.is_grad_enabled():
                raise RuntimeError(
                    f"a forest of {layout.forest.pack().num_tokens} unique tokens exceeds tree_token_budget="
                    f"{self.args.tree_token_budget} in a forward with gradients; TreeGRPOTrainer.compute_loss runs "
                    "such microbatches as planner pieces (call it, not _compute_loss, or raise tree_token_budget)")
            if compute_aux_loss:
                self._check_planner_supported()
            result = self._planned_logps(model, layout, the_plan, compute_entropy)
            self._run_fillers(model, forwards=filler_forwards)
            return result
        base = unwrap_model(model)
        with self.accelerator.autocast():
            tree, token_values, token_entropy, output = run_tree_forward(
                model, layout.forest, input_ids.device, only_loss_tokens=True, compute_entropy=compute_entropy,
                temperature=self.temperature, aux_loss=compute_aux_loss, gdn_backend=self.args.tree_gdn_backend,
                attention_backend=self.args.tree_attention_backend, float32_head=self.args.cast_lm_head_to_fp32,
                chunk_size=self.args.tree_head_chunk_size)
        packed = tree.packed
        # per packed token -> per (row, column); the gather's backward sums shared tokens' gradients
        index_rows, index_columns = layout.row_index, layout.column_index
        logps = input_ids.new_zeros(input_ids.shape, dtype=torch.float32)
        logps = logps.index_put((index_rows, index_columns), token_values[packed.sequence_token_index])
        entropies = None
        if compute_entropy:
            entropies = torch.zeros_like(logps).index_put((index_rows, index_columns),
                                                          token_entropy[packed.sequence_token_index])
        aux_loss = None
        if compute_aux_loss:
            aux_loss = load_balancing_loss(base, list(output.router_logits), packed.multiplicity)
        if torch.is_grad_enabled():
            self._record_tree_stats(dict(tree.stats(), pieces=1, handoffs=0))
        self._run_fillers(model, forwards=filler_forwards)
        keep = slice(input_ids.shape[1] - logits_to_keep, None)
        return logps[:, keep], (entropies[:, keep] if compute_entropy else None), aux_loss

    def _row_layout(self, input_ids, attention_mask, logits_to_keep) -> RowLayout:
        """The rows' forest, built once per microbatch (compute_loss and the log-prob hook share it)."""
        cached = self._layout_cache
        if (cached is not None and cached[0].shape == input_ids.shape and cached[1].shape == attention_mask.shape
                and cached[2] == logits_to_keep and torch.equal(cached[0], input_ids)
                and torch.equal(cached[1], attention_mask)):
            return cached[3]
        layout = RowLayout.of(input_ids, attention_mask, logits_to_keep, self.args.tree_share_across_groups)
        self._layout_cache = (input_ids, attention_mask, logits_to_keep, layout)
        return layout

    def _batch_layout(self, batch: dict) -> RowLayout:
        """:meth:`_row_layout` of a TRL microbatch dict (prompt and completion columns side by side)."""
        return self._row_layout(torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1),
                                torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1),
                                batch["completion_ids"].shape[1])

    def _fits_budget(self, layout: RowLayout) -> bool:
        budget = self.args.tree_token_budget
        return budget is None or layout.forest.pack().num_tokens <= budget

    def _plan(self, layout: RowLayout, replicas: int = 1) -> Plan:
        """Pieces of at most ``tree_token_budget`` unique tokens, cut at branch points (and inside longer runs, on the
        model's chunk grid), on ``replicas`` replicas (with several, a tree's pieces may sit on different replicas)."""
        return planner.plan(layout.forest.pack(), token_budget=self.args.tree_token_budget, num_replicas=replicas,
                            cost_model=self._cost_model, chunk_size=self._chunk_grid)

    def _execute_options(self) -> dict:
        return dict(temperature=self.temperature, gdn_backend=self.args.tree_gdn_backend,
                    attention_backend=self.args.tree_attention_backend,
                    float32_head=self.args.cast_lm_head_to_fp32, head_chunk_size=self.args.tree_head_chunk_size)

    def _planned_logps(self, model, layout: RowLayout, the_plan: Plan, compute_entropy: bool):
        """Forward-only pass over the plan's pieces (old / reference log-probs, evaluation): every token once."""
        with self.accelerator.autocast():
            result = execute_plan(model, the_plan, compute_entropy=compute_entropy, **self._execute_options())
        entropies = layout.to_rows(result.entropies) if compute_entropy else None
        return layout.to_rows(result.logprobs), entropies, None

    def training_step(self, model, inputs, num_items_in_batch=None):
        """TRL's step; a CUDA out-of-memory error leaves it with a note on the settings that bound a step's memory."""
        try:
            return super().training_step(model, inputs, num_items_in_batch)
        except torch.OutOfMemoryError as error:
            error.add_note(out_of_memory_note(self.args, unallocated_cuda_gib()))
            raise

    # ------------------------------------------------------------------ loss over planner pieces
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL hook, changed: a training microbatch whose forest is larger than ``tree_token_budget`` runs as
        planner pieces (:func:`harts_hf.planner.execute_plan`), each its own forward and backward with exact
        hand-offs, so no token is computed with gradient twice. The gradients are accumulated here (scaled as
        ``accelerator.backward`` would scale TRL's loss); the returned loss is TRL's value as a detached leaf, on
        which Trainer's ``accelerator.backward`` reaches no parameter. TRL's own ``_compute_loss`` logs the
        metrics on the pieces' log-probs (before the last piece's backward, as the one-forward path does). Under DDP
        with several processes a :func:`~harts_hf.planner.execute.lead_forward` comes first, so DDP's forward
        collectives come in the order of a process whose microbatch fits. Everything else is TRL's
        ``compute_loss``."""
        if (return_outputs or not self.args.use_tree or self.args.tree_token_budget is None
                or not torch.is_grad_enabled() or not self.model.training
                or any(inputs.get(key) is not None for key in MULTIMODAL_KEYS)):
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        if self.args.tree_cross_replica_handoffs and self.accelerator.num_processes > 1:
            return self._cross_replica_loss(model, inputs)
        layout = self._batch_layout(inputs)
        deepspeed = self.is_deepspeed_enabled
        pieces = int(not self._fits_budget(layout))
        if deepspeed:  # a piece's backward is a ZeRO collective: if one process runs pieces, every process does
            pieces += self._missing_passes(pieces)[0]
        if not pieces:
            return super().compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        self._check_planner_supported()
        the_plan = self._plan(layout)
        stats = self._plan_stats(the_plan)
        # DDP: all-reduce once, in the last piece's backward (earlier ones accumulate locally). DeepSpeed: one engine
        # backward per piece (ZeRO reduces each piece's gradients, as over micro-steps; no_sync is refused by ZeRO 2/3),
        # padded with filler passes to the same sequence of collectives on every process
        backward = engine_backward(self.deepspeed) if deepspeed else None
        keep = self.args.tree_keep_source_graphs  # one process (_check_planner_supported): nothing to synchronise
        no_sync = None if deepspeed or keep else functools.partial(self.accelerator.no_sync, model)
        options = dict(no_sync=no_sync, backward=backward, defer_last_backward=deepspeed, recompute=not keep,
                       **self._execute_options())
        self.last_piece_padding = 0
        if deepspeed:
            options.update(self._pad_pieces(model, the_plan, backward))
        elif self.accelerator.num_processes > 1:  # DDP's forward collectives in the one-forward order (lead_forward)
            lead_forward(model, no_sync, gdn_backend=self.args.tree_gdn_backend,
                         attention_backend=self.args.tree_attention_backend)
        if self._token_level_loss():
            loss_fn = _PieceLoss(self, layout, inputs, len(the_plan.pieces),
                                 on_last=lambda logps, entropies: self._replayed_loss(model, inputs, logps, entropies,
                                                                                      stats))
            with self.accelerator.autocast():
                execution = execute_plan(model, the_plan, loss_fn=loss_fn, compute_entropy=True,
                                         entropy_grad=loss_fn.entropy_weight is not None, **options)
            loss = loss_fn.replayed
        else:  # sequence-coupled loss: values first, then the exact gradient of TRL's loss at those values
            forwards = self._missing_passes(len(the_plan.pieces))[0] if self._zero_stage() == 3 else 0
            with torch.no_grad(), self.accelerator.autocast():
                first = execute_plan(model, the_plan, compute_entropy=True, **self._execute_options())
            self._run_fillers(model, forwards=forwards)
            logps = layout.to_rows(first.logprobs).requires_grad_()
            entropies = layout.to_rows(first.entropies).requires_grad_()
            with torch.enable_grad():
                loss = self._replayed_loss(model, inputs, logps, entropies, stats)
                grads = torch.autograd.grad(loss, [logps, entropies], allow_unused=True)
            loss_fn = _PieceLoss(self, layout, inputs, len(the_plan.pieces), linear_weights=grads)
            with self.accelerator.autocast():
                execution = execute_plan(model, the_plan, loss_fn=loss_fn, compute_entropy=True,
                                         entropy_grad=loss_fn.entropy_weight is not None, **options)
        self.last_plan_memory = execution.memory
        if execution.deferred is not None:
            # DeepSpeed: the micro-step's own backward (Trainer -> accelerator -> engine with scale_wrt_gas=False, as
            # for TRL's own loss) runs the last piece's; the value stays TRL's loss
            surrogate = backward_surrogate(*execution.deferred)
            return loss.detach() + surrogate - surrogate.detach()
        return loss.detach().requires_grad_()  # TRL's value; its backward reaches no parameter

    def _cross_replica_loss(self, model, inputs) -> torch.Tensor:
        """``tree_cross_replica_handoffs``: every process's microbatch rows as ONE forest, planned over the processes
        (a tree's pieces may run on different processes; :func:`execute_plan` with ``replica=rank`` hands states,
        keys and values, and their gradients, point to point). Each process runs its pieces under ``no_sync`` with
        TRL's per-token loss and the normalisers of the process that owns each row (so DDP's average over
        processes is TRL's objective, as without hand-offs), then one zero-loss filler forward+backward outside
        ``no_sync`` through the DDP wrapper, which all-reduces the accumulated gradients (every process runs exactly
        one; the pieces themselves call the unwrapped model). TRL's loss value and metrics come from its own
        ``_compute_loss`` on this process's rows, with every process's log-probs."""
        accelerator, rank = self.accelerator, self.accelerator.process_index
        rows = inputs["prompt_ids"].shape[0]
        everything = self._gather_microbatch(inputs)
        layout = self._batch_layout(everything)
        the_plan = self._plan(layout, replicas=accelerator.num_processes)
        weights = [token_weights(self, {key: value if key == "num_items_in_batch" else value[p * rows:(p + 1) * rows]
                                        for key, value in everything.items()})
                   for p in range(accelerator.num_processes)]  # each row normalised as on the process that owns it
        weight = torch.cat([w for w, _ in weights])
        entropy_weight = None if weights[0][1] is None else torch.cat([e for _, e in weights])
        loss_fn = _PieceLoss(self, layout, everything, weights=(weight, entropy_weight))
        # the pieces call the unwrapped model: DDP's forward broadcasts buffers (a collective) in every call, and the
        # processes run different numbers of forwards between their point-to-point hand-offs
        with accelerator.no_sync(model), accelerator.autocast():
            execution = execute_plan(accelerator.unwrap_model(model), the_plan, loss_fn=loss_fn, compute_entropy=True,
                                     replica=rank, entropy_grad=entropy_weight is not None, **self._execute_options())
        self.last_plan_memory = execution.memory
        own, width = slice(rank * rows, (rank + 1) * rows), inputs["completion_ids"].shape[1]
        logps = accelerator.reduce(loss_fn.logps, "sum")[own, :width]  # each token was computed on one process
        entropies = accelerator.reduce(loss_fn.entropies, "sum")[own, :width]
        stats = self._plan_stats(the_plan)
        share = {key: stats[key] / accelerator.num_processes for key in ("path_tokens", "unique_tokens",
                                                                         "path_attention_pairs", "tree_attention_pairs",
                                                                         "gdn_rounds", "gdn_replay_tokens",
                                                                         "pieces", "handoffs")}
        with torch.no_grad():  # the rows' totals, logged once over the processes
            loss = self._replayed_loss(model, inputs, logps, entropies, dict(stats, **share))
        self._run_fillers(model, backwards=1)  # DDP's all-reduce of everything the pieces accumulated
        self.last_piece_padding = 0  # (that filler is the synchronisation, not padding)
        return loss.detach().requires_grad_()

    def _gather_microbatch(self, inputs: dict) -> dict:
        """Every process's microbatch, rows in process order; per-row tensors padded to the widest process (prompts
        on the left, as TRL pads them). A key that is not per-row (other than ``num_items_in_batch``) is refused."""
        accelerator = self.accelerator
        rows = inputs["prompt_ids"].shape[0]
        everything = {}
        for key, value in inputs.items():
            if key == "num_items_in_batch":  # the same on every process
                everything[key] = value
                continue
            if not torch.is_tensor(value) or value.dim() == 0 or value.shape[0] != rows:
                raise ValueError(f"tree_cross_replica_handoffs moves whole rows between processes, and the "
                                 f"microbatch's {key!r} is not one value per row; set tree_cross_replica_handoffs="
                                 "False for this batch format.")
            if value.dim() > 1:
                value = accelerator.pad_across_processes(value, dim=1, pad_first=key.startswith("prompt"))
            everything[key] = accelerator.gather(value.contiguous())
        if everything["prompt_ids"].shape[0] != rows * accelerator.num_processes:
            raise RuntimeError("processes hold microbatches of different row counts; tree_cross_replica_handoffs "
                               "needs TRL's equal split (per_device_train_batch_size rows on every process)")
        return everything

    def _check_cross_replica_supported(self) -> None:
        """tree_cross_replica_handoffs: what it cannot run fails at construction, naming the fix."""
        fix = "set tree_cross_replica_handoffs=False"
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise ValueError("tree_cross_replica_handoffs runs under DDP only (DeepSpeed and FSDP reduce gradients "
                             f"in their own backward, which point-to-point hand-offs would have to follow); {fix}.")
        if not self._token_level_loss():
            raise ValueError(f"tree_cross_replica_handoffs needs a token-level loss (loss_type in {TOKEN_LEVEL_LOSSES},"
                             " importance_sampling_level='token', no off-policy mask, top_entropy_quantile=1.0): "
                             f"a sequence-level ratio would need every process's log-probs first; {fix}.")

    def _token_level_loss(self) -> bool:
        """True when TRL's loss is a sum of per-token terms known before the forward (one pass suffices)."""
        return (self.loss_type in TOKEN_LEVEL_LOSSES and self.importance_sampling_level == "token"
                and self.off_policy_mask_threshold is None and self.top_entropy_quantile >= 1.0)

    def _replayed_loss(self, model, inputs, logps, entropies, stats) -> torch.Tensor:
        """TRL's ``_compute_loss`` on the pieces' log-probs (its loss value, its metrics and their collectives, in
        the order the one-forward path issues them)."""
        self._replay = (logps, entropies, stats)
        try:
            return self._compute_loss(model, inputs)
        finally:
            self._replay = None

    def _plan_stats(self, the_plan: Plan) -> dict:
        stats = the_plan.packed.stats()
        pieces = the_plan.pieces
        stats["gdn_rounds"] = sum(p.features["rounds"] for p in pieces)
        stats["gdn_replay_tokens"] = sum(p.features["replay_tokens"] + (p.handoff.replay_tokens if p.handoff else 0)
                                         for p in pieces)
        stats["pieces"] = len(pieces)
        stats["handoffs"] = sum(p.handoff is not None for p in pieces)
        return stats

    def _check_planner_supported(self) -> None:
        check_planner_supported(self, "TreeGRPOTrainer", "TreeGRPOConfig")

    _TREE_KEYS = ("path_tokens", "unique_tokens", "R_tok", "R_att", "gdn_rounds", "gdn_replay_tokens", "pieces",
                  "handoffs")

    def _record_tree_stats(self, stats: dict) -> None:
        """Per training microbatch; summed over processes (every rank records once per microbatch)."""
        values = torch.tensor([float(stats[key]) for key in self._TREE_KEYS], device=self.accelerator.device)
        if self.accelerator.num_processes > 1:
            values = self.accelerator.gather(values.unsqueeze(0)).view(-1, len(self._TREE_KEYS))
        for row in values.view(-1, len(self._TREE_KEYS)).tolist():
            for key, value in zip(self._TREE_KEYS, row):
                self._tree_metrics[key].append(value)

    # ------------------------------------------------------------------ batching
    def _prepare_inputs(self, generation_batch):
        """TRL hook, changed: with ``tree_keep_groups_together`` the generation batch is shuffled by prompt group
        (rows with the same prompt stay adjacent, in depth-first order) instead of row by row; before that, with
        several processes and ``tree_balance_replicas``, whole prompt groups are placed on processes by tree cost
        (:meth:`_balance_replicas`)."""
        if not (self.args.use_tree and self.args.tree_keep_groups_together) or not self.model.training:
            return super()._prepare_inputs(generation_batch)
        generate_every = self.args.steps_per_generation * self.num_iterations
        if self.args.steps_per_generation > self.args.gradient_accumulation_steps:
            logger.warning_once(
                f"harts_hf: steps_per_generation={self.args.steps_per_generation} > gradient_accumulation_steps="
                f"{self.args.gradient_accumulation_steps}: each optimizer step trains on whole prompt groups "
                "(tree_keep_groups_together=True), where GRPOTrainer draws rows at random, so the rows of each step "
                "and its loss differ from GRPOTrainer's (the generation batch as a whole is the same). Set "
                "tree_keep_groups_together=False for GRPOTrainer's steps exactly, with less prefix sharing.")
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            generation_batch = self._generate_and_score_completions(generation_batch)
            if self.args.tree_balance_replicas and self.accelerator.num_processes > 1:
                generation_batch = self._balance_replicas(generation_batch)
            generation_batch = split_pixel_values_by_grid(generation_batch)
            generation_batch = _permute_rows(generation_batch, _group_permutation(generation_batch))
            batches = split_tensor_dict(generation_batch, self.args.steps_per_generation)
            self._buffered_inputs = [unsplit_pixel_values_by_grid(batch) for batch in batches]
        return self._buffered_inputs[self._step % self.args.steps_per_generation]

    def _balance_replicas(self, batch: dict) -> dict:
        """This process's rows after placing the whole generation batch's prompt groups on processes: as many rows
        as TRL gave it, about the same estimated tree cost on every process. TRL's split is kept (with a warning
        once) where moving rows would change the objective (:func:`balance_blocker`), for multimodal batches, and
        when the groups cannot be split into equal row counts. Every process must call it (collectives)."""
        blocker = balance_blocker(self)  # configuration only: the same on every process
        if blocker is not None:
            logger.warning_once(f"tree_balance_replicas keeps TRL's split of rows over processes: {blocker}, so "
                                "moving rows would change the objective.")
            return batch
        accelerator = self.accelerator
        problem, message = 0, None
        if any(batch.get(key) is not None for key in MULTIMODAL_KEYS):
            problem = 1
        else:
            try:
                layout = batch_layout(batch, self.vllm_importance_sampling_mode in ("sequence_mask", "sequence_truncate"))
            except ValueError as error:
                problem, message = 2, str(error)
        rows, checksum = batch_signature(batch)
        info = accelerator.gather(torch.tensor([[rows, checksum, problem]], device=accelerator.device)).view(-1, 3)
        if (info[:, 2] == 2).any():
            raise ValueError(message or "another process's generation batch holds a key that tree_balance_replicas "
                             "cannot move; set tree_balance_replicas=False in the TreeGRPOConfig.")
        if (info[:, :2] != info[0, :2]).any():
            raise RuntimeError(f"processes hold generation batches of different rows or keys ({info[:, 0].tolist()} "
                               "rows); tree_balance_replicas needs TRL's equal split. Set tree_balance_replicas=False.")
        if (info[:, 2] == 1).any():
            logger.warning_once("tree_balance_replicas keeps TRL's split of rows over processes for multimodal "
                                "batches (images are not moved between processes).")
            return batch
        everything = gather_generation_batch(accelerator, batch, layout, self._tokenizer.pad_token_id)
        placement = place_groups(everything, accelerator.num_processes, self._cost_model)
        before, after = imbalance(placement["loads_before"]), imbalance(placement["loads_after"])
        self._balance_metrics["replica_imbalance_before"].append(before)
        self._balance_metrics["replica_imbalance"].append(after)
        self._balance_metrics["replica_moved_rows"].append(placement["moved_rows"])
        if placement["rows"] is None:
            logger.warning_once("tree_balance_replicas keeps TRL's split of rows over processes for a generation "
                                "batch whose prompt groups cannot be split into equal row counts per process (e.g. "
                                "a group straddles two processes, or duplicate prompts merged into a larger group).")
            return batch
        return select_rows(everything, layout, placement["rows"][accelerator.process_index], self.pad_to_multiple_of)

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
            logs["tree/pieces"] = totals["pieces"]
            logs["tree/handoffs"] = totals["handoffs"]
            self._tree_metrics.clear()
        if self._balance_metrics:  # every process computed the same values: no reduction
            for key, values in self._balance_metrics.items():
                logs[f"tree/{key}"] = sum(values) / len(values)
            self._balance_metrics.clear()
        super().log(logs, start_time)


def _group_permutation(batch: dict) -> torch.Tensor:
    """A random order of prompt groups; inside a group, rows sorted by their token sequence (siblings adjacent)."""
    completion_ids, completion_mask = batch["completion_ids"], batch["completion_mask"].bool()
    completions = [tuple(ids[mask].tolist()) for ids, mask in zip(completion_ids, completion_mask)]
    members = prompt_groups(batch)
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


class _PieceLoss:
    """``loss_fn`` of :func:`execute_plan`: one piece's share of TRL's loss, scaled as ``accelerator.backward``
    scales a loss. Token-level losses use TRL's per-token formula and normalisers; with ``linear_weights``
    (``(B, T)`` gradients of TRL's loss in the log-probs and entropies) the piece's loss is their linear term.
    Records the pieces' values; after the last of ``num_pieces`` pieces (before its backward) calls
    ``on_last(logps, entropies)`` and keeps its result in ``replayed``. ``weights``: TRL's normalisers given as
    ``(weight, entropy_weight)`` instead of computed from ``inputs``."""

    def __init__(self, trainer: TreeGRPOTrainer, layout: RowLayout, inputs: dict, num_pieces: int = 0, *,
                 on_last=None, linear_weights=None, weights=None):
        self.trainer, self.layout, self.inputs = trainer, layout, inputs
        self.remaining, self.on_last, self.replayed = num_pieces, on_last, None
        if weights is not None:  # TRL's normalisers, given (rows of several processes)
            self.weight, self.entropy_weight = weights
        elif linear_weights is None:
            self.weight, self.entropy_weight = token_weights(trainer, inputs)
        else:  # a None gradient: the loss does not depend on it (entropies without an entropy bonus)
            self.weight, self.entropy_weight = linear_weights
            if self.weight is None:
                self.weight = torch.zeros(layout.shape, device=inputs["completion_ids"].device)
        self.linear = linear_weights is not None
        self.logps = torch.zeros(layout.shape, device=inputs["completion_ids"].device)
        self.entropies = torch.zeros_like(self.logps)

    def __call__(self, scored: PieceLogprobs) -> torch.Tensor:
        columns = self.layout.columns(scored.sequence, scored.position)
        keep = columns >= 0  # completion places only (prompt tokens are predicted but carry no loss)
        rows, columns, occurrence = scored.sequence[keep], columns[keep], scored.occurrence[keep]
        logps, entropies = scored.logprobs[occurrence], scored.entropies[occurrence]
        self.logps[rows, columns] = logps.detach()
        self.entropies[rows, columns] = entropies.detach()
        if self.linear:
            per_token = logps
        else:
            per_token = token_level_loss(self.trainer, logps, rows, columns, self.inputs)
        loss = (self.weight[rows, columns] * per_token).sum()
        if self.entropy_weight is not None:
            loss = loss + (self.entropy_weight[rows, columns] * entropies).sum()
        self.remaining -= 1
        if self.remaining == 0 and self.on_last is not None:
            with torch.no_grad():
                self.replayed = self.on_last(self.logps, self.entropies)
        accelerator = self.trainer.accelerator
        if not self.trainer.is_deepspeed_enabled:  # under DeepSpeed, Trainer passes scale_wrt_gas=False: no division
            loss = loss / accelerator.gradient_accumulation_steps
        return accelerator.scaler.scale(loss) if accelerator.scaler is not None else loss
