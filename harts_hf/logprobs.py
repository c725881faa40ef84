"""tree_logprobs: per-sequence token log-probs (and entropies) of a batch from ONE tree forward.

Token t is predicted from the hidden row of ``parent[t]``; a branch point's row is gathered once per
child, and the gather's backward sums the children's gradients into the shared row.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from transformers.utils import logging

from .kernels import TreeMetadata
from .model_patches.core import _PATCH_MARK, TREE_KWARG, apply_tree_patches, model_type_of
from .trees import PackedForest, PrefixForest

__all__ = ["TreeLogprobs", "tree_forward", "tree_logprobs"]

logger = logging.get_logger(__name__)

# A 4-D attention mask is passed through transformers' mask builders untouched; tree mixers ignore it.
_TREE_MASK_PLACEHOLDER = torch.empty(1, 1, 0, 0, dtype=torch.bool)


@dataclass
class TreeLogprobs:
    """Output of :func:`tree_logprobs`.

    ``logprobs[i]``: ``[len(s_i) - 1]`` log-probs of tokens 1.. of sequence i; ``entropies[i]`` likewise (or None);
    ``aux_loss``: the MoE load-balancing loss weighted as over all trajectories (or None); ``token_logprobs``
    ``[U]`` per packed token (0 at roots); ``packed``; ``stats`` (forest + plan statistics).
    """

    logprobs: list[torch.Tensor]
    entropies: list[torch.Tensor] | None
    aux_loss: torch.Tensor | None
    token_logprobs: torch.Tensor
    token_entropies: torch.Tensor | None
    packed: PackedForest
    stats: dict

    def padded(self, padding_value: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs as ``[N, max(L_i) - 1]`` plus the bool mask of real positions."""
        return _pad(self.logprobs, padding_value)


def _pad(rows: list[torch.Tensor], padding_value: float):
    length = max(1, max(row.shape[0] for row in rows))
    out = rows[0].new_full((len(rows), length), padding_value)
    mask = torch.zeros(len(rows), length, dtype=torch.bool, device=out.device)
    for i, row in enumerate(rows):
        out[i, : row.shape[0]] = row
        mask[i, : row.shape[0]] = True
    return out, mask


def _text_config(model):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _ensure_patched(model):
    handle = getattr(model, _PATCH_MARK, None)
    if handle is None or not handle.active:
        logger.info("harts_hf: applying tree patches to %s (no-ops for calls without tree metadata)", type(model).__name__)
        handle = apply_tree_patches(model)
    return handle


def _check_inputs(model, packed: PackedForest) -> None:
    config = _text_config(model)
    vocab = model.get_input_embeddings().num_embeddings
    largest = int(packed.input_ids.max())
    if largest >= vocab:
        token = int(torch.argmax((packed.input_ids >= vocab).long()))
        raise ValueError(f"sequences hold token id {int(packed.input_ids[token])} >= the model's vocabulary size "
                         f"{vocab}; check the tokenizer matches the model.")
    limit = getattr(config, "max_position_embeddings", None)
    depth = int(packed.position_ids.max()) + 1
    if limit is not None and depth > limit:
        raise ValueError(f"a sequence has {depth} tokens, more than the model's max_position_embeddings ({limit}); "
                         "truncate the sequences or raise config.max_position_embeddings.")


def tree_forward(model, tree: TreeMetadata, *, output_router_logits: bool = False):
    """Run the model's decoder once over the forest: returns the decoder output (``last_hidden_state [1, U, H]``)."""
    decoder = model.get_decoder()
    packed = tree.packed
    kwargs = {"output_router_logits": True} if output_router_logits else {}
    return decoder(
        input_ids=packed.input_ids.unsqueeze(0),
        position_ids=packed.position_ids.unsqueeze(0),
        attention_mask=_TREE_MASK_PLACEHOLDER.to(packed.device),
        use_cache=False,
        **{TREE_KWARG: tree},
        **kwargs,
    )


def tree_logprobs(model, sequences, *, compute_entropy: bool = False, temperature: float = 1.0,
                  loss_masks=None, only_loss_tokens: bool = False, return_aux_loss: bool = False,
                  forest: PrefixForest | None = None, gdn_backend: str = "auto",
                  attention_backend: str = "auto") -> TreeLogprobs:
    """Log-probs of every sequence's tokens 1.. given their prefix, from one forward over the prefix forest.

    Args:
        model: a transformers causal LM of a supported family (patched on first use; the patches are no-ops
            for ordinary calls, see :func:`harts_hf.model_patches.apply_tree_patches`).
        sequences: token-id lists or 1-D integer tensors (any lengths >= 1).
        compute_entropy: also return the entropy of each predicted distribution.
        temperature: logits are divided by it before the softmax (as TRL does).
        loss_masks / only_loss_tokens: with ``only_loss_tokens``, the lm head runs only on tokens that carry
            loss in some sequence; other positions get 0.
        return_aux_loss: MoE models: the load-balancing loss with every unique token weighted by its
            multiplicity, equal to the loss over all trajectories.
        forest: a prebuilt :class:`PrefixForest` of ``sequences`` (skips building it).
        gdn_backend / attention_backend: kernel choice (``"auto"`` picks fla/fast paths on CUDA only).

    Returns:
        :class:`TreeLogprobs`; differentiable w.r.t. the model's parameters.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if forest is None:
        forest = PrefixForest.from_sequences(sequences, loss_masks=loss_masks)
    handle = _ensure_patched(model)
    device = model.get_input_embeddings().weight.device
    packed = forest.pack()
    _check_inputs(model, packed)
    tree = TreeMetadata(packed, device, gdn_backend=gdn_backend, attention_backend=attention_backend)
    packed = tree.packed

    moe_aux = return_aux_loss and handle.family.moe
    if return_aux_loss and not handle.family.moe:
        raise ValueError(f"return_aux_loss=True but {model_type_of(model)} has no routed experts")
    outputs = tree_forward(model, tree, output_router_logits=moe_aux)
    hidden = outputs.last_hidden_state[0]

    targets = torch.nonzero(packed.parent >= 0).squeeze(1)
    if only_loss_tokens:
        targets = targets[packed.loss_mask[targets]]
    logits = model.get_output_embeddings()(hidden.index_select(0, packed.parent[targets]))
    logits = logits.float() / temperature
    log_probs = logits.log_softmax(-1)
    picked = log_probs.gather(-1, packed.input_ids[targets].unsqueeze(-1)).squeeze(-1)
    token_logprobs = picked.new_zeros(packed.num_tokens).index_copy(0, targets, picked)
    token_entropies = None
    if compute_entropy:
        entropy = -(log_probs.exp() * log_probs).sum(-1)
        token_entropies = entropy.new_zeros(packed.num_tokens).index_copy(0, targets, entropy)

    per_sequence = [x[1:] for x in packed.gather_sequences(token_logprobs)]
    entropies = [x[1:] for x in packed.gather_sequences(token_entropies)] if compute_entropy else None
    aux_loss = None
    if moe_aux:
        aux_loss = _load_balancing_loss(model, outputs.router_logits, packed.multiplicity)
    return TreeLogprobs(per_sequence, entropies, aux_loss, token_logprobs, token_entropies, packed, tree.stats())


def _load_balancing_loss(model, router_logits, multiplicity: torch.Tensor) -> torch.Tensor:
    """The family's own load-balancing loss with each unique token weighted by its multiplicity."""
    config = _text_config(model)
    module = sys.modules[type(model).__module__]
    loss_function = module.load_balancing_loss_func
    return loss_function(tuple(router_logits), config.num_experts, config.num_experts_per_tok,
                         multiplicity.unsqueeze(0).float())
