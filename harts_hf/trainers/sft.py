"""TreeSFTTrainer: TRL's SFTTrainer with each microbatch's rows computed as one prefix forest.

Rows that share a prefix (a system prompt, a conversation's earlier turns, several completions of one prompt) have
it computed once, forward and backward; the loss and its gradients are SFTTrainer's without packing: the summed
negative log-likelihood of the label tokens over ``num_items_in_batch`` (their count when not given), DFT's
weighting, the MoE load-balancing loss over every row's tokens, TRL's scaling across processes. A microbatch whose
forest exceeds ``tree_token_budget`` runs as planner pieces (each its own forward and backward, exact hand-offs);
``tree_per_turn_rows`` turns every conversation into one row per assistant turn, the rows sharing their history.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from datasets import Dataset
from transformers.utils import logging
from trl import SFTConfig, SFTTrainer
from trl.data_utils import is_conversational_from_value, maybe_convert_to_chatml

from .. import planner  # planner.plan looked up per call, as the trainers always did
from .._checks import check_bool, check_int, trainer_args
from ..logprobs import tree_logprobs, unwrap_model
from ..model_patches import apply_tree_patches, chunk_grid, cpu_safe, keep_attention_outputs
from ..model_patches.core import _PATCH_MARK
from ..planner import Plan
from ..planner.execute import PieceLogprobs, backward_surrogate, engine_backward, execute_plan, lead_forward
from ..trees import PackedForest, PrefixForest
from .config import (
    _ATTENTION_BACKENDS,
    _GDN_BACKENDS,
    AUTOCAST_EXPERTS_HELP,
    EXECUTED_MIXERS_HELP,
    KEEP_MIXER_GIB_HELP,
    KEEP_MIXER_OUTPUTS_HELP,
    KEEP_SOURCE_GRAPHS_HELP,
    MAMBA_CHUNK_SIZE_HELP,
    MAMBA_SCAN_INPUTS_HELP,
    MATMUL_GIB_HELP,
    MATMUL_LAYERS_HELP,
    SHARED_KEYS_HELP,
    STORED_LAYERS_HELP,
    VARLEN_KERNEL_HELP,
    apply_layer_counts,
    apply_process_settings,
    check_dropout,
    check_layer_counts,
    check_planner_supported,
    check_process_settings,
)
from .piece_padding import PiecePadding

__all__ = ["TreeSFTConfig", "TreeSFTTrainer", "forest_rows", "per_turn_rows"]

logger = logging.get_logger(__name__)

_BACKENDS = {"tree_gdn_backend": _GDN_BACKENDS, "tree_attention_backend": _ATTENTION_BACKENDS}
_LOSS_TYPES = ("nll", "dft")


@dataclass
class TreeSFTConfig(SFTConfig):
    r"""Configuration of [`TreeSFTTrainer`]: every [`~trl.SFTConfig`] field, plus the fields below."""

    use_tree: bool = field(default=True, metadata={
        "help": "Compute each microbatch's rows as one prefix forest (shared prefixes once). False trains exactly like "
                "SFTTrainer."})
    tree_gdn_backend: str = field(default="auto", metadata={
        "help": "Linear-attention kernel on trees: 'auto' (fla on CUDA when installed, else PyTorch), 'torch' or "
                "'fla'."})
    tree_attention_backend: str = field(default="auto", metadata={
        "help": "Softmax-attention kernel on trees: 'auto', 'sdpa', 'runs', 'varlen' or 'cudnn' (as TreeGRPOConfig)."})
    tree_varlen_kernel: str | None = field(default=None, metadata={"help": VARLEN_KERNEL_HELP})
    tree_autocast_experts: str | None = field(default=None, metadata={"help": AUTOCAST_EXPERTS_HELP})
    tree_mamba_scan_inputs: str | None = field(default=None, metadata={"help": MAMBA_SCAN_INPUTS_HELP})
    tree_mamba_chunk_size: str | None = field(default=None, metadata={"help": MAMBA_CHUNK_SIZE_HELP})
    tree_shared_keys_in_place: bool | None = field(default=None, metadata={"help": SHARED_KEYS_HELP})
    tree_executed_mixers: bool | None = field(default=None, metadata={"help": EXECUTED_MIXERS_HELP})
    tree_head_chunk_size: int = field(default=4096, metadata={
        "help": "Rows of the LM head computed at once in tree mode (bounds the logits' memory)."})
    tree_keep_attention_outputs: bool = field(default=True, metadata={
        "help": "With gradient checkpointing: keep each attention kernel's output from the forward so the "
                "backward's rerun skips attention (the same gradients)."})
    tree_keep_mixer_outputs: bool = field(default=False, metadata={"help": KEEP_MIXER_OUTPUTS_HELP})
    tree_keep_mixer_gib: float | None = field(default=None, metadata={"help": KEEP_MIXER_GIB_HELP})
    tree_keep_source_graphs: bool = field(default=False, metadata={"help": KEEP_SOURCE_GRAPHS_HELP})
    tree_stored_layers: int = field(default=0, metadata={"help": STORED_LAYERS_HELP})
    tree_keep_matmul_layers: int = field(default=0, metadata={"help": MATMUL_LAYERS_HELP})
    tree_keep_matmul_gib: float | None = field(default=None, metadata={"help": MATMUL_GIB_HELP})
    tree_token_budget: int | None = field(default=None, metadata={
        "help": "Most unique tokens in one tree forward. A microbatch whose forest is larger runs as planner pieces "
                "cut at branch points, each its own forward and backward, with exact hand-offs (every token computed "
                "once; the same loss, gradients and metrics); evaluation runs such microbatches as forward-only "
                "pieces. Under DDP and DeepSpeed ZeRO-2/3 (bf16); not with the MoE load-balancing loss "
                "(router_aux_loss_coef), DeepSpeed with fp16, FSDP or LOMO. A "
                "stretch without a branch point longer than the budget is cut inside, at chunk boundaries (its parts "
                "hand over as at a branch point). None: one forward per microbatch."})
    tree_per_turn_rows: bool = field(default=False, metadata={
        "help": "Conversational datasets ('messages' column): train on one row per assistant turn instead of one "
                "row per conversation. Row t is the conversation up to and including its t-th assistant message, "
                "rendered by the chat template as at inference (a template that drops earlier turns' thinking drops "
                "it there too), with the loss on that last assistant message only (TRL's conversational "
                "prompt-completion rows: prompt = the messages before it, completion = it; with assistant_only_loss "
                "the loss is further limited to its {% generation %} span). A conversation's rows are consecutive in "
                "the dataset and share their history, which tree execution computes once when they fall in the same "
                "microbatch (Trainer's default random sampler scatters them: train_sampling_strategy='sequential' on "
                "a dataset of conversations shuffled beforehand keeps them together). Works with use_tree=False too "
                "(SFTTrainer on the same rows)."})

    def __post_init__(self):
        self.use_tree = check_bool(self.use_tree, "use_tree")
        self.tree_keep_attention_outputs = check_bool(self.tree_keep_attention_outputs, "tree_keep_attention_outputs")
        self.tree_keep_source_graphs = check_bool(self.tree_keep_source_graphs, "tree_keep_source_graphs")
        self.tree_per_turn_rows = check_bool(self.tree_per_turn_rows, "tree_per_turn_rows")
        self.tree_head_chunk_size = check_int(self.tree_head_chunk_size, "tree_head_chunk_size")
        self.tree_token_budget = check_int(self.tree_token_budget, "tree_token_budget", allow_none=True)
        for name, choices in _BACKENDS.items():
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {getattr(self, name)!r}.")
        check_process_settings(self)
        super().__post_init__()
        check_layer_counts(self)
        if self.tree_per_turn_rows and self.completion_only_loss is False:
            raise ValueError("TreeSFTConfig: tree_per_turn_rows=True puts each row's loss on its last assistant turn "
                             "(TRL's completion_only_loss), but completion_only_loss=False would train on the whole "
                             "history; leave completion_only_loss=None (or True), or set tree_per_turn_rows=False.")
        if self.tree_per_turn_rows and (self.dataset_kwargs or {}).get("skip_prepare_dataset"):
            raise ValueError("TreeSFTConfig: tree_per_turn_rows=True builds conversational prompt-completion rows that "
                             "SFTTrainer then tokenizes, and dataset_kwargs={'skip_prepare_dataset': True} skips that "
                             "step; drop skip_prepare_dataset, or set tree_per_turn_rows=False and pass tokenized rows.")
        if not self.use_tree:
            return
        if self.loss_type not in _LOSS_TYPES:
            raise ValueError(f"TreeSFTConfig: loss_type={self.loss_type!r} is not computed on trees (it needs "
                             f"{_LOSS_TYPES}); set use_tree=False to train it with SFTTrainer.")
        if self.label_smoothing_factor:
            raise ValueError(f"TreeSFTConfig: label_smoothing_factor={self.label_smoothing_factor} needs the full "
                             "logits, which tree execution does not build; set it to 0 or use_tree=False.")
        if self.use_liger_kernel:
            raise ValueError("TreeSFTConfig: use_liger_kernel=True and use_tree=True both replace how the loss is "
                             "computed; set use_liger_kernel=False to train on trees, or use_tree=False.")


class TreeSFTTrainer(PiecePadding, SFTTrainer):
    """[`~trl.SFTTrainer`] whose training and evaluation loss runs every microbatch as one prefix forest
    (:func:`harts_hf.tree_logprobs`), or as planner pieces beyond ``tree_token_budget``: the same loss and gradients
    as SFTTrainer without packing, each shared prefix computed once. Takes SFTTrainer's arguments; with
    ``tree_per_turn_rows`` the conversational datasets are first split into one row per assistant turn
    (:func:`per_turn_rows`)."""

    def __init__(self, model, args: TreeSFTConfig | None = None, data_collator=None, train_dataset=None,
                 eval_dataset=None, processing_class=None, compute_loss_func=None, **kwargs):
        args = trainer_args(args, TreeSFTConfig, model, "TreeSFTTrainer", "SFTConfig")
        if args.use_tree and compute_loss_func is not None:
            raise ValueError("TreeSFTTrainer: compute_loss_func receives the full logits, which tree execution does "
                             "not build; pass compute_loss_func=None or set use_tree=False.")
        if args.tree_per_turn_rows:
            num_proc = args.dataset_num_proc
            if train_dataset is not None:
                train_dataset = per_turn_rows(train_dataset, name="train_dataset", num_proc=num_proc)
            if isinstance(eval_dataset, dict):
                eval_dataset = type(eval_dataset)({key: per_turn_rows(value, name=f"eval_dataset[{key!r}]",
                                                                      num_proc=num_proc)
                                                   for key, value in eval_dataset.items()})
            elif eval_dataset is not None:
                eval_dataset = per_turn_rows(eval_dataset, name="eval_dataset", num_proc=num_proc)
        super().__init__(model, args, data_collator, train_dataset, eval_dataset, processing_class,
                         compute_loss_func, **kwargs)
        if args.tree_per_turn_rows and args.assistant_only_loss and self.chat_template is not None:
            raise ValueError("TreeSFTTrainer: tree_per_turn_rows=True renders each row as the chat template renders "
                             "it at inference, but with assistant_only_loss=True and a template without "
                             "{% generation %} markers TRL renders the rows with its own training template, which "
                             "can render the history differently (Qwen3's keeps every earlier turn's thinking). Set "
                             "assistant_only_loss=False (each row's loss is on its last assistant turn already), or "
                             "give a chat template with {% generation %} markers.")
        if args.use_tree and args.tree_token_budget is not None:
            self._check_planner_supported()
        self._tree_handles = []
        base = unwrap_model(self.model)
        if not args.use_tree:  # SFTTrainer's path; still no CPU tensor reaches a Triton kernel
            self._tree_handles.append(cpu_safe(base))
        else:
            if getattr(base, _PATCH_MARK, None) is None:
                self._tree_handles.append(apply_tree_patches(base))
            check_dropout(base, "TreeSFTTrainer", logger, "Zero it before training: "
                          "trl.trainer.utils.disable_dropout_in_model(model) zeroes every dropout module")
            apply_process_settings(args)
            if args.tree_keep_attention_outputs:
                keep_attention_outputs(base)
        apply_layer_counts(base, args, logger)
        self._chunk_grid = chunk_grid(base)  # where the planner may cut inside a run

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """SFTTrainer's hook, changed: with ``use_tree`` the microbatch's rows are one prefix forest, computed in one
        tree forward, or, when it has more unique tokens than ``tree_token_budget``, as planner pieces
        (:meth:`_planned_loss`). SFTTrainer's loss value and metrics either way. ``return_outputs`` (the logits for
        ``compute_metrics``) takes SFTTrainer's own forward."""
        if not self.args.use_tree or return_outputs:
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        rows, masks = forest_rows(inputs)
        forest = self._microbatch_forest(rows, masks)
        budget = self.args.tree_token_budget
        over = budget is not None and forest.pack().num_tokens > budget
        if budget is not None and self.is_deepspeed_enabled and (torch.is_grad_enabled() or self._zero_stage() == 3):
            # a piece's backward (ZeRO-3: also its forward) is a collective: if one process runs pieces, all do
            over = self._missing_passes(int(over))[0] > 0 or over
        if over:
            return self._planned_loss(model, forest, rows, masks, num_items_in_batch)
        out = tree_logprobs(model, forest=forest, only_loss_tokens=True, compute_entropy=True,
                            return_aux_loss=self.aux_loss_enabled, gdn_backend=self.args.tree_gdn_backend,
                            attention_backend=self.args.tree_attention_backend,
                            head_chunk_size=self.args.tree_head_chunk_size, compute_top1=True)
        log_probs, entropies, correct = self._label_values(masks, out.logprobs, out.entropies, out.is_top1)
        loss = self._sft_loss(log_probs, num_items_in_batch)
        mode = "train" if self.model.training else "eval"
        if self.aux_loss_enabled:
            steps = self.current_gradient_accumulation_steps if num_items_in_batch is not None else 1
            loss = loss + self.router_aux_loss_coef * out.aux_loss / steps
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(out.aux_loss.detach()).mean().item())
        self._record_metrics(mode, log_probs, entropies, correct, dict(out.stats, pieces=1, handoffs=0), rows)
        return loss

    def _microbatch_forest(self, rows: list, masks: list) -> PrefixForest:
        """The prefix forest of a microbatch's ``rows`` (token-id lists) with their label ``masks``: rows share their
        common prefixes. (The benchmarks' packed per-row baseline overrides it to keep every row its own tree.)"""
        return PrefixForest.from_sequences(rows, loss_masks=masks)

    def _planned_loss(self, model, forest: PrefixForest, rows, masks, num_items_in_batch) -> torch.Tensor:
        """The microbatch as planner pieces (:func:`harts_hf.planner.execute_plan`). With gradients each piece runs its
        own forward and backward, its loss the share of SFTTrainer's loss its tokens carry, scaled as
        ``Trainer.training_step`` and ``accelerator.backward`` scale the returned loss (:meth:`_backward_scale`);
        DDP all-reduces in the last piece's backward (the others under ``no_sync``), and the metrics, whose
        collectives the one-forward path issues before Trainer's backward, are logged just before it. The returned
        loss is SFTTrainer's value as a detached leaf, on which Trainer's backward reaches no parameter. Without
        gradients (evaluation) every piece runs forward only."""
        packed = forest.pack()
        the_plan = self._plan(packed)
        stats = dict(packed.stats(), pieces=len(the_plan.pieces),
                     handoffs=sum(piece.handoff is not None for piece in the_plan.pieces))
        device = unwrap_model(model).get_input_embeddings().weight.device
        # the LM head scores only label tokens, and flags whether each is its distribution's argmax (token accuracy)
        options = dict(compute_entropy=True, only_loss_tokens=True, compute_top1=True, **self._execute_options())
        predicted = [len(row) - 1 for row in rows]

        def summarise(logprobs, entropies, top1) -> torch.Tensor:  # per row; SFTTrainer's loss, the metrics logged
            log_probs, entropies, correct = self._label_values(masks, logprobs, entropies, top1)
            mode = "train" if self.model.training else "eval"
            self._record_metrics(mode, log_probs, entropies, correct, stats, rows)
            return self._sft_loss(log_probs, num_items_in_batch)

        self.last_piece_padding = 0
        if not torch.is_grad_enabled():
            # ZeRO-3 all-gathers parameters in every forward: as many on every process (counted before any runs: the
            # count is a collective too)
            fillers = self._missing_passes(len(the_plan.pieces))[0] if self._zero_stage() == 3 else 0
            execution = execute_plan(model, the_plan, **options)
            self._run_fillers(model, forwards=fillers)
            return summarise(execution.logprobs, execution.entropies, execution.is_top1)
        num_labels = sum(int(mask[1:].sum()) for mask in masks)
        scale = self._backward_scale(num_items_in_batch)
        loss_fn = _PieceLoss(masks, scale * self._token_weight(num_labels, num_items_in_batch, device),
                             self.args.loss_type == "dft", self.accelerator.scaler, device, len(the_plan.pieces),
                             on_last=lambda *values: summarise(*(value.split(predicted) for value in values)))
        # DDP: the pieces but the last under no_sync, its backward all-reduces. DeepSpeed: one engine backward per
        # piece (ZeRO reduces each, as over micro-steps), padded with filler passes to the same collectives on every
        # process; the last piece's backward is the Trainer's own
        deepspeed = self.is_deepspeed_enabled
        backward = engine_backward(self.deepspeed) if deepspeed else None
        keep = self.args.tree_keep_source_graphs  # one process (_check_planner_supported): nothing to synchronise
        no_sync = None if deepspeed or keep else functools.partial(self.accelerator.no_sync, model)
        options.update(no_sync=no_sync, backward=backward, defer_last_backward=deepspeed, recompute=not keep)
        if deepspeed:
            options.update(self._pad_pieces(model, the_plan, backward))
        elif self.accelerator.num_processes > 1:  # DDP's forward collectives in the one-forward order (lead_forward)
            lead_forward(model, no_sync, gdn_backend=self.args.tree_gdn_backend,
                         attention_backend=self.args.tree_attention_backend)
        execution = execute_plan(model, the_plan, loss_fn=loss_fn, entropy_grad=False, **options)
        if execution.deferred is not None:
            # Trainer's backward of the returned loss runs the last piece's, times ``scale`` (the pieces' losses
            # carry it already); its value stays SFTTrainer's loss
            surrogate = backward_surrogate(*execution.deferred) / scale
            return loss_fn.summary.detach() + surrogate - surrogate.detach()
        return loss_fn.summary.detach().requires_grad_()

    def _execute_options(self) -> dict:
        """:func:`execute_plan`'s options of this trainer's tree forwards."""
        return dict(gdn_backend=self.args.tree_gdn_backend, attention_backend=self.args.tree_attention_backend,
                    head_chunk_size=self.args.tree_head_chunk_size)

    def _plan(self, packed: PackedForest) -> Plan:
        """Pieces of at most ``tree_token_budget`` unique tokens, cut at branch points (and inside longer
        stretches without one, on the model's chunk grid)."""
        return planner.plan(packed, token_budget=self.args.tree_token_budget, chunk_size=self._chunk_grid)

    def _label_values(self, masks, logprobs, entropies, is_top1):
        """The label tokens' log-probs, entropies and argmax flags (flat, rows in order) from per-row values."""
        device = logprobs[0].device
        chosen = [mask[1:].to(device) for mask in masks]
        return tuple(torch.cat([value[m] for value, m in zip(values, chosen)])
                     for values in (logprobs, entropies, is_top1))

    def _sft_loss(self, log_probs: torch.Tensor, num_items_in_batch) -> torch.Tensor:
        """SFTTrainer's loss of the label tokens' log-probs ``[n]``: their negative sum (DFT: each weighted by its
        probability, no gradient) over ``num_items_in_batch`` (n when None), times the processes when tokens are
        averaged across devices."""
        per_token_loss = -log_probs
        if self.args.loss_type == "dft":  # DFT: each token's loss weighted by its probability (no gradient)
            per_token_loss = per_token_loss * log_probs.exp().detach()
        return per_token_loss.sum() * self._token_weight(log_probs.numel(), num_items_in_batch, log_probs.device)

    def _token_weight(self, num_labels: int, num_items_in_batch, device) -> torch.Tensor:
        """The factor of each label token's loss in SFTTrainer's loss (see :meth:`_sft_loss`)."""
        num_tokens = num_labels if num_items_in_batch is None else num_items_in_batch
        weight = 1 / torch.as_tensor(num_tokens, device=device).clamp(min=1)
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            weight = weight * (self.accelerator.num_processes // self.get_tp_size())
        return weight

    def _backward_scale(self, num_items_in_batch) -> float:
        """What ``Trainer.training_step`` and ``accelerator.backward`` multiply ``compute_loss``'s value by before the
        backward: ``1 / current_gradient_accumulation_steps`` unless the loss counts as scaled for gradient
        accumulation, then ``1 / accelerator.gradient_accumulation_steps`` (not under DeepSpeed: accelerate leaves
        that division to the engine, which Trainer tells not to, ``scale_wrt_gas=False``). Outside the training loop
        (no accumulation steps set) the caller's own backward: 1."""
        scaled = self.loss_is_scaled_for_ga
        if scaled is None:
            scaled = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or self.compute_loss_func is not None
        scale = 1.0 if scaled else 1.0 / getattr(self, "current_gradient_accumulation_steps", 1)
        return scale if self.is_deepspeed_enabled else scale / self.accelerator.gradient_accumulation_steps

    def _record_metrics(self, mode: str, log_probs, entropies, correct, stats: dict, rows) -> None:
        """SFTTrainer's metrics of the microbatch (entropy, mean_token_accuracy over the label tokens, num_tokens),
        summed over processes, and the forest's under ``tree/``."""
        device = log_probs.device
        num_valid = self.accelerator.gather_for_metrics(torch.tensor(log_probs.numel(), device=device)).sum()
        entropy_sum = self.accelerator.gather_for_metrics(entropies.detach().sum()).sum()
        num_correct = self.accelerator.gather_for_metrics(correct.sum()).sum()
        self._metrics[mode]["entropy"].append((entropy_sum / num_valid).item() if num_valid > 0 else 0.0)
        self._metrics[mode]["mean_token_accuracy"].append((num_correct / num_valid).item() if num_valid > 0 else 0.0)
        for key in ("R_tok", "unique_tokens", "path_tokens", "pieces", "handoffs"):
            if key in stats:
                self._metrics[mode][f"tree/{key}"].append(float(stats[key]))
        if mode == "train":
            local = torch.tensor(sum(map(len, rows)), device=device)
            self._total_train_tokens += self.accelerator.gather_for_metrics(local).sum().item() // self._tp_size
        self._metrics[mode]["num_tokens"] = [self._total_train_tokens]

    def _check_planner_supported(self) -> None:
        check_planner_supported(self, "TreeSFTTrainer", "TreeSFTConfig")


class _PieceLoss:
    """``loss_fn`` of :func:`execute_plan`: one piece's share of SFTTrainer's loss, ``weight`` times the sum of its
    label tokens' ``-log_prob`` (DFT: times their probability, no gradient), scaled by the AMP ``scaler`` if any.
    ``masks``: per row, which tokens carry loss (``[len_i]`` bool). Keeps the pieces' log-probs, entropies and
    argmax flags per place of every row (``[sum(len_i - 1)]``, rows in order); once the last of ``num_pieces``
    pieces is scored (before its backward), ``summary = on_last(log_probs, entropies, is_top1)`` (without
    gradient)."""

    def __init__(self, masks, weight: torch.Tensor, dft: bool, scaler, device, num_pieces: int, on_last):
        lengths = torch.tensor([len(mask) - 1 for mask in masks], device=device)
        self.starts = torch.cumsum(lengths, 0) - lengths  # each row's first predicted place in the flat layout
        self.carries = torch.cat([mask[1:] for mask in masks]).to(device)
        self.log_probs = torch.zeros(self.carries.shape, device=device)
        self.entropies = torch.zeros_like(self.log_probs)
        self.is_top1 = torch.zeros(self.carries.shape, dtype=torch.bool, device=device)
        self.weight, self.dft, self.scaler = weight, dft, scaler
        self.remaining, self.on_last, self.summary = num_pieces, on_last, None

    def __call__(self, scored: PieceLogprobs) -> torch.Tensor:
        places = self.starts[scored.sequence] + scored.position
        self.log_probs[places] = scored.logprobs[scored.occurrence].detach()
        self.entropies[places] = scored.entropies[scored.occurrence].detach()
        self.is_top1[places] = scored.is_top1[scored.occurrence]
        log_probs = scored.logprobs[scored.occurrence[self.carries[places]]]
        per_token_loss = -log_probs
        if self.dft:
            per_token_loss = per_token_loss * log_probs.exp().detach()
        loss = per_token_loss.sum() * self.weight
        self.remaining -= 1
        if self.remaining == 0:
            with torch.no_grad():
                self.summary = self.on_last(self.log_probs, self.entropies, self.is_top1)
        return self.scaler.scale(loss) if self.scaler is not None else loss


def forest_rows(inputs: dict) -> tuple[list[list[int]], list[torch.Tensor]]:
    """The sequences of a collated SFT microbatch and each one's loss mask (a token carries loss where its label is
    not -100): padded rows (``attention_mask``) or padding-free / packed rows (``position_ids`` restarting at 0)."""
    if any(inputs.get(key) is not None for key in ("pixel_values", "image_grid_thw", "pixel_attention_mask")):
        raise ValueError("TreeSFTTrainer: multimodal batches do not run on trees; set use_tree=False")
    ids, labels = inputs["input_ids"], inputs.get("labels")
    if labels is None:
        raise ValueError("TreeSFTTrainer: the batch has no labels; use TRL's SFT collator (it sets them)")
    if "position_ids" in inputs and "attention_mask" not in inputs:
        starts = [torch.nonzero(row == 0).squeeze(1).tolist() + [row.numel()] for row in inputs["position_ids"]]
        spans = [(b, s, e) for b, cut in enumerate(starts) for s, e in zip(cut[:-1], cut[1:])]
        selections = [(b, slice(s, e)) for b, s, e in spans]
    else:
        mask = inputs.get("attention_mask", torch.ones_like(ids)).bool()
        selections = [(b, mask[b]) for b in range(ids.shape[0])]
    rows, masks = [], []
    for b, sel in selections:
        tokens, targets = ids[b][sel], labels[b][sel]
        carries = targets != -100
        if not torch.equal(targets[carries], tokens[carries]):
            raise ValueError("TreeSFTTrainer: labels differ from input_ids where they are not -100 (shifted or "
                             "rewritten labels); tree execution scores each row's own next tokens. Use TRL's SFT "
                             "collator, or use_tree=False.")
        if tokens.numel():
            rows.append(tokens.tolist())
            masks.append(carries.cpu())
    return rows, masks


def per_turn_rows(dataset, *, name: str = "dataset", num_proc: int | None = None):
    """``tree_per_turn_rows``: one conversational prompt-completion row per assistant message of every conversation
    (``messages`` column; ShareGPT ``conversations`` rows are converted to it first, as SFTTrainer does): ``prompt``
    = the messages before it, ``completion`` = ``[it]``, every other column copied. SFTTrainer then renders
    ``prompt + completion`` with the chat template (the history as at inference) and puts the loss on the
    completion, the tokens after the rendered prompt with its generation prompt. A conversation's rows stay
    consecutive, in turn order. ``dataset``: a ``datasets`` Dataset or IterableDataset; ``name`` appears in errors."""
    first = next(iter(dataset), None)
    if first is None:
        return dataset
    if is_conversational_from_value(first):
        dataset = dataset.map(maybe_convert_to_chatml, remove_columns="conversations")
        first = next(iter(dataset))
    messages = first.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise ValueError(f"tree_per_turn_rows=True splits conversations into one row per assistant turn, but {name} "
                         f"has no conversational 'messages' column (its columns: {sorted(first)}); give rows of "
                         "{'messages': [{'role': ..., 'content': ...}, ...]}, or set tree_per_turn_rows=False.")
    taken = sorted({"prompt", "completion"} & set(first))
    if taken:
        raise ValueError(f"tree_per_turn_rows=True writes each turn's 'prompt' and 'completion' columns, and {name} "
                         f"already has {taken}; drop or rename them, or set tree_per_turn_rows=False.")

    def split(batch: dict, indices: list[int]) -> dict:
        others = [key for key in batch if key != "messages"]
        out = {key: [] for key in ["prompt", "completion", *others]}
        for i, (index, messages) in enumerate(zip(indices, batch["messages"])):
            turns = [t for t, message in enumerate(messages) if message["role"] == "assistant"]
            if not turns or turns[0] == 0:
                problem = "has no assistant message" if not turns else "starts with an assistant message"
                raise ValueError(f"tree_per_turn_rows=True: conversation {index} of {name} {problem}, so it gives "
                                 "no row whose history precedes an assistant turn; remove it or start it with a "
                                 "system or user message, or set tree_per_turn_rows=False.")
            for t in turns:
                out["prompt"].append(messages[:t])
                out["completion"].append([messages[t]])
                for key in others:
                    out[key].append(batch[key][i])
        return out

    options = {}
    if isinstance(dataset, Dataset):  # an IterableDataset's map takes neither
        options = dict(num_proc=num_proc, desc=f"One row per assistant turn ({name})")
    return dataset.map(split, batched=True, with_indices=True, remove_columns=["messages"], **options)
