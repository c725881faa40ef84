"""TreeSFTTrainer: TRL's SFTTrainer with each microbatch's rows computed as one prefix forest.

Rows that share a prefix (a system prompt, a conversation's earlier turns, several completions of one prompt) have
it computed once, forward and backward; the loss and its gradients are SFTTrainer's without packing: the summed
negative log-likelihood of the label tokens over ``num_items_in_batch`` (their count when not given), DFT's
weighting, the MoE load-balancing loss over every row's tokens, TRL's scaling across processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.utils import logging
from trl import SFTConfig, SFTTrainer

from .._checks import check_bool, check_int, trainer_args
from ..logprobs import tree_logprobs, unwrap_model
from ..model_patches import apply_tree_patches, cpu_safe, keep_attention_outputs
from ..model_patches.core import _PATCH_MARK
from .config import _ATTENTION_BACKENDS, _GDN_BACKENDS

__all__ = ["TreeSFTConfig", "TreeSFTTrainer"]

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
    tree_head_chunk_size: int = field(default=4096, metadata={
        "help": "Rows of the LM head computed at once in tree mode (bounds the logits' memory)."})
    tree_keep_attention_outputs: bool = field(default=True, metadata={
        "help": "With gradient checkpointing: keep each attention kernel's output from the forward so the "
                "backward's rerun skips attention (the same gradients)."})

    def __post_init__(self):
        self.use_tree = check_bool(self.use_tree, "use_tree")
        self.tree_keep_attention_outputs = check_bool(self.tree_keep_attention_outputs, "tree_keep_attention_outputs")
        self.tree_head_chunk_size = check_int(self.tree_head_chunk_size, "tree_head_chunk_size")
        for name, choices in _BACKENDS.items():
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {getattr(self, name)!r}.")
        super().__post_init__()
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


class TreeSFTTrainer(SFTTrainer):
    """[`~trl.SFTTrainer`] whose training and evaluation loss runs every microbatch as one prefix forest
    (:func:`harts_hf.tree_logprobs`): the same loss and gradients as SFTTrainer without packing, each shared
    prefix computed once. Takes SFTTrainer's arguments."""

    def __init__(self, model, args: TreeSFTConfig | None = None, *posargs, compute_loss_func=None, **kwargs):
        args = trainer_args(args, TreeSFTConfig, model, "TreeSFTTrainer", "SFTConfig")
        if args.use_tree and compute_loss_func is not None:
            raise ValueError("TreeSFTTrainer: compute_loss_func receives the full logits, which tree execution does "
                             "not build; pass compute_loss_func=None or set use_tree=False.")
        super().__init__(model, args, *posargs, compute_loss_func=compute_loss_func, **kwargs)
        self._tree_handles = []
        base = unwrap_model(self.model)
        if not args.use_tree:  # SFTTrainer's path; still no CPU tensor reaches a Triton kernel
            self._tree_handles.append(cpu_safe(base))
        else:
            if getattr(base, _PATCH_MARK, None) is None:
                self._tree_handles.append(apply_tree_patches(base))
            if args.tree_keep_attention_outputs:
                keep_attention_outputs(base)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not self.args.use_tree or return_outputs:  # the logits for compute_metrics need the plain forward
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        mode = "train" if self.model.training else "eval"
        rows, masks = forest_rows(inputs)
        out = tree_logprobs(model, rows, loss_masks=masks, only_loss_tokens=True, compute_entropy=True,
                            return_aux_loss=self.aux_loss_enabled, gdn_backend=self.args.tree_gdn_backend,
                            attention_backend=self.args.tree_attention_backend,
                            head_chunk_size=self.args.tree_head_chunk_size, compute_top1=True)
        device = out.token_logprobs.device
        chosen = [mask[1:].to(device) for mask in masks]
        log_probs = torch.cat([lp[m] for lp, m in zip(out.logprobs, chosen)])
        entropies = torch.cat([e[m] for e, m in zip(out.entropies, chosen)])
        correct = torch.cat([t[m] for t, m in zip(out.is_top1, chosen)])
        per_token_loss = -log_probs
        if self.args.loss_type == "dft":  # DFT: each token's loss weighted by its probability (no gradient)
            per_token_loss = per_token_loss * log_probs.exp().detach()
        num_tokens = log_probs.numel() if num_items_in_batch is None else num_items_in_batch
        loss = per_token_loss.sum() / torch.as_tensor(num_tokens, device=device).clamp(min=1)
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * (self.accelerator.num_processes // self.get_tp_size())
        if self.aux_loss_enabled:
            steps = self.current_gradient_accumulation_steps if num_items_in_batch is not None else 1
            loss = loss + self.router_aux_loss_coef * out.aux_loss / steps
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(out.aux_loss.detach()).mean().item())
        num_valid = self.accelerator.gather_for_metrics(torch.tensor(log_probs.numel(), device=device)).sum()
        entropy_sum = self.accelerator.gather_for_metrics(entropies.detach().sum()).sum()
        num_correct = self.accelerator.gather_for_metrics(correct.sum()).sum()
        self._metrics[mode]["entropy"].append((entropy_sum / num_valid).item() if num_valid > 0 else 0.0)
        self._metrics[mode]["mean_token_accuracy"].append((num_correct / num_valid).item() if num_valid > 0 else 0.0)
        stats = out.stats
        for key in ("R_tok", "unique_tokens", "path_tokens"):
            if key in stats:
                self._metrics[mode][f"tree/{key}"].append(float(stats[key]))
        if mode == "train":
            local = torch.tensor(sum(map(len, rows)), device=device)
            self._total_train_tokens += self.accelerator.gather_for_metrics(local).sum().item() // self._tp_size
        self._metrics[mode]["num_tokens"] = [self._total_train_tokens]
        return loss


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
