"""Log-probs (and entropies) of chosen tokens through the LM head, a chunk of rows at a time.

Each chunk runs under activation checkpointing, so only one chunk's ``[rows, vocab]`` logits exist at a
time, in the forward and again in the backward. The head is called as a module (FSDP hooks fire), except
under DeepSpeed ZeRO-3 (``functional_head``): there every module call all-gathers the weight, a collective
that each process must issue equally often, but the chunk count follows each process's own token count (two
processes with 11 and 10 chunks wait on each other forever); so the weight is read directly, an external
parameter of the model that ZeRO-3 gathers once for the whole forward and backward (``apply_tree_patches``).
Math in fp32: ``z = head(h) / T``, ``logp = z[y] - logsumexp(z)``, ``H = -sum(p log p)``; on CUDA through the
fused kernels of :mod:`.logprob_stats` (the head's output read in its own dtype, no fp32 ``[rows, vocab]`` copy).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from .._checks import check_int, check_number
from .logprob_stats import logprob_entropy, logprob_stats_backend

__all__ = ["chunked_logprobs"]


def transform_logits(logits: torch.Tensor, logit_scale: float | None = None,
                     logit_softcap: float | None = None) -> torch.Tensor:
    """What a model's forward does to its LM head's output, as the model does it: times ``logit_scale``, then
    ``c * tanh(logits / c)`` for ``c = logit_softcap``."""
    if logit_scale is not None:
        logits = logits * logit_scale
    if logit_softcap is not None:
        logits = torch.tanh(logits / logit_softcap) * logit_softcap
    return logits


def _score_chunk(head, hidden, labels, temperature: float, compute_entropy: bool, float32_head: bool,
                 entropy_grad: bool = True, functional_head: bool = False, logit_scale: float | None = None,
                 logit_softcap: float | None = None, compute_top1: bool = False):
    """``(logprobs, entropies or an empty tensor, top1 or an empty tensor)`` of one chunk of rows."""
    bias = getattr(head, "bias", None)
    if float32_head:
        with torch.autocast(hidden.device.type, enabled=False):
            logits = torch.nn.functional.linear(hidden.float(), head.weight.float(),
                                                None if bias is None else bias.float())
    elif functional_head:
        logits = torch.nn.functional.linear(hidden, head.weight, bias)
    else:
        logits = head(hidden)
    logits = transform_logits(logits, logit_scale, logit_softcap)
    if logprob_stats_backend(logits) == "triton":
        picked, entropy, top1 = logprob_entropy(logits, labels, temperature, backend="triton", return_top1=True)
        if not compute_entropy:
            entropy = picked.new_zeros(0)
        return picked, entropy if entropy_grad else entropy.detach(), top1 if compute_top1 else top1[:0]
    top1 = logits.argmax(-1) == labels if compute_top1 else labels.new_zeros(0, dtype=torch.bool)
    log_probs = (logits.float() / temperature).log_softmax(-1)
    picked = log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    if not compute_entropy:
        return picked, picked.new_zeros(0), top1
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        return picked, -(log_probs.exp() * log_probs).sum(-1), top1


def chunked_logprobs(head: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor, *, temperature: float = 1.0,
                     chunk_size: int = 4096, compute_entropy: bool = False,
                     float32_head: bool = False, entropy_grad: bool = True, functional_head: bool = False,
                     logit_scale: float | None = None, logit_softcap: float | None = None,
                     compute_top1: bool = False) -> tuple[torch.Tensor, ...]:
    """``hidden [N, H]`` through ``head`` (the LM head), ``labels [N]`` -> fp32 ``logprobs [N]`` and
    ``entropies [N]`` (or None). ``float32_head``: project in fp32 outside autocast (TRL's cast_lm_head_to_fp32).
    ``entropy_grad=False``: entropies without gradient (metrics, masks). Pass it whenever the loss does not
    differentiate them: an entropy with gradient that the backward never reaches leaves its chunk's recomputed
    ``[rows, vocab]`` tensors stashed by the checkpoint until the entropies are dropped (~4.6 GiB per 4096 rows
    at vocabulary 152k; measured on the GPU as ~37 GiB for a 30k-token planner piece). ``functional_head``:
    ``linear(hidden, head.weight, head.bias)`` instead of calling the module (ZeRO-3, see the module doc).
    ``logit_scale`` / ``logit_softcap``: what the model's forward does to the head's output before the temperature
    (:func:`transform_logits`). ``compute_top1``: also return ``top1 [N]`` bool, whether each label is its row's
    argmax (first maximum; SFTTrainer's token accuracy), as a third output."""
    if hidden.shape[0] != labels.shape[0]:
        raise ValueError(f"chunked_logprobs: {hidden.shape[0]} rows but {labels.shape[0]} labels")
    temperature = check_number(temperature, "chunked_logprobs: temperature")
    chunk_size = check_int(chunk_size, "chunked_logprobs: chunk_size")
    logprobs, entropies, top1 = [], [], []
    use_checkpoint = torch.is_grad_enabled() and hidden.shape[0] > chunk_size
    for start in range(0, max(hidden.shape[0], 1), chunk_size):
        rows = slice(start, start + chunk_size)
        arguments = (head, hidden[rows], labels[rows], temperature, compute_entropy, float32_head, entropy_grad,
                     functional_head, logit_scale, logit_softcap, compute_top1)
        if use_checkpoint:
            picked, entropy, is_top1 = checkpoint(_score_chunk, *arguments, use_reentrant=False)
        else:
            picked, entropy, is_top1 = _score_chunk(*arguments)
        logprobs.append(picked)
        entropies.append(entropy)
        top1.append(is_top1)
    result = torch.cat(logprobs), (torch.cat(entropies) if compute_entropy else None)
    return (*result, torch.cat(top1)) if compute_top1 else result
