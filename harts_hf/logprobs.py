"""tree_logprobs: per-sequence token log-probs (and entropies) of a batch from ONE tree forward.

Token t is predicted from the hidden row of ``parent[t]``; a branch point's row is gathered once per
child, and the gather's backward sums the children's gradients into the shared row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.utils import logging

from ._checks import check_int, check_number
from .kernels import TreeMetadata
from .model_patches.core import _PATCH_MARK, apply_tree_patches, model_type_of
from .model_patches.entry import TREE_REQUEST_KWARG, TreeRequest, text_config
from .trees import PackedForest, PrefixForest

__all__ = ["TreeLogprobs", "check_tree_inputs", "run_tree_forward", "tree_logprobs", "unwrap_model"]

logger = logging.get_logger(__name__)


@dataclass
class TreeLogprobs:
    """Output of :func:`tree_logprobs`.

    ``logprobs[i]``: ``[len(s_i) - 1]`` log-probs of tokens 1.. of sequence i (0 where not computed, see
    ``only_loss_tokens``); ``entropies[i]`` likewise (or None); ``aux_loss``: the MoE load-balancing loss
    weighted as over all trajectories (or None); ``token_logprobs [U]`` per packed token (0 at roots);
    ``packed``; ``stats`` (forest + plan statistics); with ``compute_top1``, ``is_top1[i]``: ``[len(s_i) - 1]``
    bool, whether each token is the argmax of its predicted distribution (False where not computed).
    """

    logprobs: list[torch.Tensor]
    entropies: list[torch.Tensor] | None
    aux_loss: torch.Tensor | None
    token_logprobs: torch.Tensor
    token_entropies: torch.Tensor | None
    packed: PackedForest
    stats: dict
    is_top1: list[torch.Tensor] | None = None


def unwrap_model(model):
    """The transformers model inside DDP / DeepSpeed / compile wrappers and PEFT's ``PeftModel`` (its adapter
    layers stay in the model: only the wrapper's forwarding is skipped)."""
    while True:
        if callable(getattr(type(model), "get_base_model", None)):  # PEFT: PeftModel -> its tuner's model
            model = model.get_base_model()
            continue
        if hasattr(model, "get_decoder"):
            return model
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if inner is None:
            raise TypeError(f"tree execution needs a transformers causal LM, got {type(model).__name__}")
        model = inner


def _ensure_patched(model):
    handle = getattr(model, _PATCH_MARK, None)
    if handle is None or not handle.active:
        logger.info("harts_hf: applying tree patches to %s (no-ops for calls without tree metadata)", type(model).__name__)
        handle = apply_tree_patches(model)
    return handle


def check_tree_inputs(model, packed: PackedForest) -> None:
    """Token ids inside the vocabulary, depths inside the position limit; raises ValueError otherwise."""
    config = text_config(model)
    vocab = model.get_input_embeddings().num_embeddings
    if int(packed.input_ids.max()) >= vocab:
        raise ValueError(f"sequences hold token id {int(packed.input_ids.max())} >= the model's vocabulary size "
                         f"{vocab}; check that the tokenizer matches the model.")
    limit = getattr(config, "max_position_embeddings", None)
    depth = int(packed.position_ids.max()) + 1
    if limit is not None and depth > limit:
        raise ValueError(f"a sequence has {depth} tokens, more than the model's max_position_embeddings ({limit}); "
                         "truncate the sequences or raise config.max_position_embeddings.")


def tree_logprobs(model, sequences=None, *, compute_entropy: bool = False, temperature: float = 1.0,
                  loss_masks=None, only_loss_tokens: bool = False, return_aux_loss: bool = False,
                  forest: PrefixForest | None = None, gdn_backend: str = "auto", attention_backend: str = "auto",
                  float32_head: bool = False, head_chunk_size: int = 4096, compute_top1: bool = False) -> TreeLogprobs:
    """Log-probs of every sequence's tokens 1.. given their prefix, from one forward over the prefix forest.

    Args:
        model: a transformers causal LM of a supported family, possibly inside DDP / DeepSpeed (the call goes
            through the wrapper). Patched on first use; the patches are no-ops for ordinary calls.
        sequences: token-id lists or 1-D integer tensors (any lengths >= 1); or give ``forest``.
        compute_entropy: also return the entropy of each predicted distribution.
        temperature: logits are divided by it before the softmax (as TRL does).
        loss_masks / only_loss_tokens: with ``only_loss_tokens``, the LM head runs only on tokens that carry
            loss in some sequence; other positions get 0.
        return_aux_loss: MoE models: the load-balancing loss with every unique token weighted by its
            multiplicity, equal to the loss over all trajectories.
        forest: a prebuilt :class:`PrefixForest` (then ``sequences`` and ``loss_masks`` are not used).
        gdn_backend / attention_backend: kernel choice (``"auto"`` picks fast paths on CUDA only).
        float32_head / head_chunk_size: LM head in fp32; rows per LM-head chunk.
        compute_top1: also whether each token is its distribution's argmax (SFT's token accuracy).

    Returns:
        :class:`TreeLogprobs`; differentiable w.r.t. the model's parameters.
    """
    temperature = check_number(temperature, "tree_logprobs: temperature")
    head_chunk_size = check_int(head_chunk_size, "tree_logprobs: head_chunk_size")
    if forest is None:
        if sequences is None:
            raise ValueError("pass sequences or forest")
        forest = PrefixForest.from_sequences(sequences, loss_masks=loss_masks)
    base = unwrap_model(model)
    handle = _ensure_patched(base)
    if return_aux_loss and not handle.family.moe:
        raise ValueError(f"return_aux_loss=True but {model_type_of(base)} has no load-balancing loss harts_hf can "
                         "weight by multiplicity (no routed experts, or no load_balancing_loss_func in its modeling "
                         "module)")
    tree, token_logprobs, token_entropies, output = run_tree_forward(
        model, forest, base.get_input_embeddings().weight.device, only_loss_tokens=only_loss_tokens,
        compute_entropy=compute_entropy, temperature=temperature, aux_loss=return_aux_loss, gdn_backend=gdn_backend,
        attention_backend=attention_backend, float32_head=float32_head, chunk_size=head_chunk_size,
        compute_top1=compute_top1)
    packed = tree.packed
    per_sequence = [x[1:] for x in packed.gather_sequences(token_logprobs)]
    entropies = [x[1:] for x in packed.gather_sequences(token_entropies)] if compute_entropy else None
    top1 = None
    if compute_top1:
        top1 = [x[1:] for x in packed.gather_sequences(output.is_top1)]
    return TreeLogprobs(per_sequence, entropies, output.aux_loss, token_logprobs, token_entropies, packed, tree.stats(),
                        top1)


def run_tree_forward(model, forest: PrefixForest, device, *, only_loss_tokens: bool, compute_entropy: bool,
                     temperature: float, aux_loss: bool, gdn_backend: str, attention_backend: str,
                     float32_head: bool, chunk_size: int, compute_top1: bool = False):
    """One tree request through ``model`` (already patched): returns ``(tree, token_logprobs [U],
    token_entropies [U] or None, output)``, per-token values 0 where nothing was predicted (roots, and tokens
    without loss when ``only_loss_tokens``); with ``compute_top1``, ``output.is_top1 [U]`` per packed token too
    (False there)."""
    packed = forest.pack()
    check_tree_inputs(unwrap_model(model), packed)
    tree = TreeMetadata(packed, device, gdn_backend=gdn_backend, attention_backend=attention_backend)
    packed = tree.packed
    predicted = packed.parent >= 0
    if only_loss_tokens:
        predicted &= packed.loss_mask
    targets = torch.nonzero(predicted).squeeze(1)
    request = TreeRequest(tree, targets, temperature=temperature, compute_entropy=compute_entropy,
                          aux_loss=aux_loss, float32_head=float32_head, chunk_size=chunk_size, compute_top1=compute_top1)
    output = model(**{TREE_REQUEST_KWARG: request})
    if compute_top1:  # per packed token, as the values returned
        output.is_top1 = torch.zeros(packed.num_tokens, dtype=torch.bool, device=targets.device).index_copy(
            0, targets, output.is_top1)

    def per_token(values):
        return values.new_zeros(packed.num_tokens).index_copy(0, targets, values)

    return tree, per_token(output.logprobs), (per_token(output.entropies) if compute_entropy else None), output
