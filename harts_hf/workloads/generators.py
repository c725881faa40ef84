"""Simple workload generators: GRPO prompt groups and full trees of fixed fan-out.

The agentic (multi-turn, thinking-dropping) generator lives in :mod:`harts_hf.workloads.agentic`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np

from .workload import (
    DEFAULT_VOCAB_SIZE,
    SequenceBuilder,
    SpanDrawer,
    Workload,
    check_count,
    check_length,
    check_nonnegative,
    check_vocab_size,
)

__all__ = ["fixed_branching", "grpo_groups"]


def grpo_groups(
    num_prompts: int,
    group_size: int,
    prompt_len: float,
    completion_len: float,
    *,
    system_prompt_len: float = 0,
    prompt_len_sigma: float = 0.3,
    completion_len_sigma: float = 0.5,
    max_length_factor: float = 8.0,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    seed: int = 0,
) -> Workload:
    """GRPO-style groups: ``num_prompts * group_size`` sequences ``[system] + prompt_i + completion_ij``.

    Args:
        num_prompts: number of prompts (groups), >= 1.
        group_size: completions sampled per prompt, >= 1; they share the prompt.
        prompt_len: mean prompt length in tokens, >= 1 (lognormal, see ``prompt_len_sigma``).
        completion_len: mean completion length in tokens, >= 1 (lognormal, see ``completion_len_sigma``).
        system_prompt_len: length of a system prompt shared by every sequence (exact; 0 = none).
        prompt_len_sigma: log-space standard deviation of prompt lengths (0 = every prompt ``prompt_len`` long).
        completion_len_sigma: log-space standard deviation of completion lengths.
        max_length_factor: lengths are clipped to this multiple of their mean (>= 1); every length is >= 1.
        vocab_size: token ids are drawn from ``[0, vocab_size)``.
        seed: seed of ``np.random.default_rng``; the same arguments give the same workload.

    Only completion tokens carry loss.
    """
    params = dict(num_prompts=num_prompts, group_size=group_size, prompt_len=prompt_len,
                  completion_len=completion_len, system_prompt_len=system_prompt_len,
                  prompt_len_sigma=prompt_len_sigma, completion_len_sigma=completion_len_sigma,
                  max_length_factor=max_length_factor, vocab_size=vocab_size, seed=seed)
    check_count("num_prompts", num_prompts)
    check_count("group_size", group_size)
    check_length("prompt_len", prompt_len)
    check_length("completion_len", completion_len)
    check_nonnegative("system_prompt_len", system_prompt_len)
    check_nonnegative("prompt_len_sigma", prompt_len_sigma)
    check_nonnegative("completion_len_sigma", completion_len_sigma)
    check_length("max_length_factor", max_length_factor)
    draw = SpanDrawer(np.random.default_rng(seed), check_vocab_size(vocab_size))

    root = SequenceBuilder()
    if round(system_prompt_len) > 0:
        root.add(draw.tokens(round(system_prompt_len)), loss=False)
    sequences, loss_masks = [], []
    for _ in range(num_prompts):
        prompt = root.copy().add(draw.span(prompt_len, prompt_len_sigma, max_length_factor), loss=False)
        for _ in range(group_size):
            completion = draw.span(completion_len, completion_len_sigma, max_length_factor)
            prompt.emit(sequences, loss_masks, (completion, True))
    return Workload("grpo_groups", sequences, loss_masks, params)


def fixed_branching(
    branching: Sequence[int] = (6, 6, 6),
    segment_len: int | Sequence[int] = 64,
    *,
    root_len: int = 128,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    seed: int = 0,
) -> Workload:
    """A full tree: a root span, then ``branching[l]`` children of every node at level ``l``.

    Args:
        branching: fan-out per level, each >= 1; there are ``prod(branching)`` sequences, one per leaf path,
            in depth-first order.
        segment_len: tokens per non-root node, >= 1: one int for every level or one per level.
        root_len: tokens of the shared root span (prompt, no loss), >= 0; 0 makes the first level roots.
        vocab_size: token ids are drawn from ``[0, vocab_size)``.
        seed: seed of ``np.random.default_rng``.

    Unique tokens: ``root_len + sum_l segment_len[l] * prod(branching[:l + 1])``. Non-root tokens carry loss.
    """
    params = dict(branching=tuple(branching) if isinstance(branching, Sequence) else branching,
                  segment_len=segment_len, root_len=root_len, vocab_size=vocab_size, seed=seed)
    if isinstance(branching, (str, bytes)) or not isinstance(branching, Sequence) or len(branching) == 0:
        raise ValueError(f"branching = {branching!r}; expected a non-empty sequence of fan-outs >= 1.")
    fan_outs = [check_count(f"branching[{level}]", value) for level, value in enumerate(branching)]
    if isinstance(segment_len, Sequence):
        if len(segment_len) != len(fan_outs):
            raise ValueError(f"segment_len has {len(segment_len)} entries; expected one per level ({len(fan_outs)}) "
                             "or a single int.")
        lengths = [check_count(f"segment_len[{level}]", value) for level, value in enumerate(segment_len)]
    else:
        lengths = [check_count("segment_len", segment_len)] * len(fan_outs)
    check_count("root_len", root_len, minimum=0)
    if math.prod(fan_outs) > 1_000_000:
        raise ValueError(f"branching = {tuple(fan_outs)} gives {math.prod(fan_outs)} sequences; expected at most 1e6.")
    draw = SpanDrawer(np.random.default_rng(seed), check_vocab_size(vocab_size))

    root = SequenceBuilder()
    if root_len > 0:
        root.add(draw.tokens(root_len), loss=False)
    nodes: dict[tuple[int, ...], SequenceBuilder] = {(): root}
    for level, (fan_out, length) in enumerate(zip(fan_outs, lengths)):
        for parent in itertools.product(*(range(f) for f in fan_outs[:level])):
            for child in range(fan_out):
                nodes[parent + (child,)] = nodes[parent].copy().add(draw.tokens(length), loss=True)
    sequences, loss_masks = [], []
    for leaf in itertools.product(*(range(f) for f in fan_outs)):
        nodes[leaf].emit(sequences, loss_masks)
    return Workload("fixed_branching", sequences, loss_masks, params)
