"""The tree entry point on the model's own ``forward``: ``model(harts_tree_request=TreeRequest(...))``.

Going through ``model(...)`` rather than calling the decoder directly keeps wrappers in the loop: DDP
prepares its gradient all-reduce in its forward, DeepSpeed and FSDP run their hooks. Calls without the
keyword go to the original ``forward`` untouched.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from transformers.utils import ModelOutput

from ..kernels import TreeMetadata
from ..kernels.chunked_logprobs import chunked_logprobs, transform_logits
from .core import TREE_KWARG, tree_forward_running, zero3_enabled

__all__ = ["TREE_REQUEST_KWARG", "TreeForwardOutput", "TreeRequest", "serve_tree_requests"]

TREE_REQUEST_KWARG = "harts_tree_request"
# A 4-D attention mask is passed through transformers' mask builders untouched; tree mixers ignore it.
_TREE_MASK_PLACEHOLDER = torch.empty(1, 1, 0, 0, dtype=torch.bool)


@dataclass
class TreeRequest:
    """What one tree forward computes.

    ``tree``: the forest on the model's device; ``targets [n]`` (long): packed tokens whose log-prob is wanted
    (each predicted from its parent's hidden row); ``temperature``; ``compute_entropy``; ``aux_loss``: return
    the MoE load-balancing loss weighted by multiplicity; ``float32_head``: LM head in fp32; ``chunk_size``:
    rows per LM-head chunk; ``entropy_grad``: entropies with gradient (False when the loss does not use them, see
    :func:`harts_hf.kernels.chunked_logprobs.chunked_logprobs`); ``compute_top1``: also whether each target is its
    row's argmax (SFT's token accuracy).
    """

    tree: TreeMetadata
    targets: torch.Tensor
    temperature: float = 1.0
    compute_entropy: bool = False
    aux_loss: bool = False
    float32_head: bool = False
    chunk_size: int = 4096
    entropy_grad: bool = True
    compute_top1: bool = False


@dataclass
class TreeForwardOutput(ModelOutput):
    """``logprobs [n]`` and ``entropies [n]`` (fp32) of the requested targets; with ``aux_loss`` requested, the
    multiplicity-weighted load-balancing loss and the per-layer ``router_logits [U, experts]``; with
    ``compute_top1``, ``is_top1 [n]`` (bool)."""

    logprobs: torch.Tensor | None = None
    entropies: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    router_logits: tuple | None = None
    is_top1: torch.Tensor | None = None


def serve_tree_requests(model, original_forward, *args, **kwargs):
    """The patched root model's forward (a :class:`~.core.PatchedForward` handler): a ``harts_tree_request``
    call runs :func:`run_tree_request`; every other call goes to ``original_forward``."""
    request = kwargs.pop(TREE_REQUEST_KWARG, None)
    if request is None:
        return original_forward(*args, **kwargs)
    given = sorted(name for name, value in kwargs.items() if value is not None)  # wrappers (PEFT) pass Nones on
    if args or given:
        raise ValueError(f"a tree request takes no other inputs; got {len(args)} positional and {given}")
    return run_tree_request(model, request)


def text_config(model):
    """The text (language-model) config of ``model``, also inside vision-language models."""
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def logit_transform(model) -> dict:
    """What the model's forward does to the LM head's output before returning logits, as ``chunked_logprobs``
    arguments: a multiplier (Cohere's ``logit_scale``, Granite's ``1 / logits_scaling``, Falcon-H1's
    ``lm_head_multiplier``) and the final-logit softcapping (Gemma 2). :func:`check_logit_transform` verifies it
    against the model's own forward."""
    config = text_config(model)
    scale = getattr(model, "logit_scale", None)
    if getattr(config, "logits_scaling", None):
        scale = 1.0 / config.logits_scaling
    if getattr(config, "lm_head_multiplier", None) is not None:
        scale = config.lm_head_multiplier
    return {"logit_scale": None if scale is None or scale == 1 else float(scale),
            "logit_softcap": getattr(config, "final_logit_softcapping", None)}


def check_logit_transform(model) -> None:
    """Refuse a model whose forward turns the LM head's output into logits in a way :func:`logit_transform` does
    not reproduce: a 3-token forward of the model against the head on its decoder's last hidden state."""
    device = model.get_input_embeddings().weight.device
    ids = torch.arange(3, device=device).unsqueeze(0) % model.get_input_embeddings().weight.shape[0]
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            expected = model(input_ids=ids, use_cache=False).logits[0].float()
            hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state[0]
            got = transform_logits(model.get_output_embeddings()(hidden), **logit_transform(model)).float()
    finally:
        model.train(training)
    if got.shape != expected.shape or not torch.allclose(got, expected, rtol=1e-4, atol=1e-4 * expected.abs().max()):
        difference = (got - expected).abs().max().item() if got.shape == expected.shape else "shape"
        raise ValueError(f"model_type {text_config(model).model_type!r}: the model's forward turns the LM head's "
                         f"output into logits in a way harts_hf does not reproduce (max difference {difference}); "
                         "train it without trees (TreeGRPOConfig(use_tree=False))")


def check_tree_forward(model) -> None:
    """Refuse a model found by its structure (:func:`.core.attention_interface_family`) whose tree forward does not
    reproduce its own forward: four short sequences (two forks off one path, one nested, a second root) scored on
    their prefix forest and one sequence at a time. It catches what the structure does not show: a layer that reads
    the attention mask or its token positions some other way, a mixer that drops the tree's keyword argument, a
    module named like a per-token one that mixes tokens. Log-probs must agree to 1e-3 where the weights are fp32 or
    fp64 (outside autocast); in half precision the tree forward only has to run."""
    from ..logprobs import tree_logprobs
    from ..reference import per_sequence_logprobs

    vocab = model.get_input_embeddings().weight.shape[0]
    path = [(11 * i + 5) % vocab for i in range(14)]
    sequences = [path, path[:4] + [(7 * i + 2) % vocab for i in range(9)], path[:9] + [(3 * i + 1) % vocab for i in range(4)],
                 [(5 * i + 3) % vocab for i in range(6)]]
    model_type = text_config(model).model_type
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            try:
                tree = tree_logprobs(model, sequences).logprobs
            except Exception as error:
                raise ValueError(f"model_type {model_type!r} (found by its structure) fails on a prefix forest "
                                 f"({type(error).__name__}: {error}); harts_hf cannot run it on trees. Train it without "
                                 "trees (TreeGRPOConfig(use_tree=False)) or register a TreeFamily for it.") from error
            weights = model.get_input_embeddings().weight
            device = weights.device.type
            if weights.dtype not in (torch.float32, torch.float64) or torch.is_autocast_enabled(device):
                return
            reference = per_sequence_logprobs(model, sequences)[0]
    finally:
        model.train(training)
    difference = max((a.float() - b.float()).abs().max().item() for a, b in zip(tree, reference))
    if not difference <= 1e-3:
        raise ValueError(f"model_type {model_type!r} (found by its structure) gives other log-probs on a prefix forest "
                         f"than one sequence at a time (max difference {difference:.3g} on a 4-sequence probe): some "
                         "layer reads the attention mask or token positions in a way harts_hf does not reproduce. Train "
                         "it without trees (TreeGRPOConfig(use_tree=False)) or register a TreeFamily for it.")


def run_tree_request(model, request: TreeRequest) -> TreeForwardOutput:
    """One decoder pass over the forest, then the LM head on the parents of ``request.targets``; a piece with a
    hand-off predicts its root from the handed-in hidden row and exports its branch tokens' rows."""
    packed = request.tree.packed
    kwargs = {"output_router_logits": True} if request.aux_loss else {}
    with tree_forward_running():
        outputs = model.get_decoder()(
            input_ids=packed.input_ids.unsqueeze(0),
            position_ids=packed.position_ids.unsqueeze(0),
            attention_mask=_TREE_MASK_PLACEHOLDER.to(packed.device),
            use_cache=False,
            **{TREE_KWARG: request.tree},
            **kwargs,
        )
    hidden_rows, parents = outputs.last_hidden_state[0], packed.parent[request.targets]
    tree = request.tree
    for export in tree.exports:
        export.record(("hidden",), hidden_rows[export.branch_token])
    if tree.context is not None:  # the root's token is predicted from the branch token's row, handed in as row U
        hidden_rows = torch.cat([hidden_rows, tree.context.hidden().to(hidden_rows.dtype).unsqueeze(0)])
        parents = torch.where(parents >= 0, parents, packed.num_tokens)
    hidden = hidden_rows.index_select(0, parents)
    logprobs, entropies, *top1 = chunked_logprobs(
        model.get_output_embeddings(), hidden, packed.input_ids[request.targets], temperature=request.temperature,
        chunk_size=request.chunk_size, compute_entropy=request.compute_entropy, float32_head=request.float32_head,
        entropy_grad=request.entropy_grad, functional_head=zero3_enabled(), compute_top1=request.compute_top1,
        **logit_transform(model))
    aux_loss = router_logits = None
    if request.aux_loss:
        router_logits = tuple(outputs.router_logits)
        aux_loss = load_balancing_loss(model, router_logits, packed.multiplicity)
    return TreeForwardOutput(logprobs=logprobs, entropies=entropies, aux_loss=aux_loss, router_logits=router_logits,
                             is_top1=top1[0] if top1 else None)


def load_balancing_loss(model, router_logits, weights: torch.Tensor) -> torch.Tensor:
    """The family's own load-balancing loss with each router row weighted by ``weights`` (multiplicity)."""
    config = text_config(model)
    loss_function = sys.modules[type(model).__module__].load_balancing_loss_func
    num_experts = getattr(config, "num_experts", None) or config.num_local_experts  # Mixtral / GPT-OSS spelling
    return loss_function(tuple(router_logits), num_experts, config.num_experts_per_tok, weights.unsqueeze(0).float())
