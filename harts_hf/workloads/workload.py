"""The Workload container and the shared pieces of every generator.

A workload is a batch of token sequences with their loss masks. Generators draw token spans with
:class:`SpanDrawer`: spans drawn fewer than ``vocab_size`` spans apart never share a first token, so
prefixes merge only where the structure shares them, never by chance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from harts_hf.trees import PrefixForest

__all__ = ["DEFAULT_VOCAB_SIZE", "SpanDrawer", "Workload", "SequenceBuilder"]

DEFAULT_VOCAB_SIZE = 151936  # Qwen2/Qwen3 vocabulary


@dataclass
class Workload:
    """A batch of ``N`` training sequences.

    ``sequences``: ``N`` lists of token ids in ``[0, vocab_size)``; ``loss_masks``: ``N`` lists of bools, as long
    as their sequence, True on assistant tokens (thinking, actions, completions); ``name``: the generator or preset;
    ``params``: the arguments that produced it (enough to reproduce it).
    """

    name: str
    sequences: list[list[int]]
    loss_masks: list[list[bool]]
    params: dict = field(default_factory=dict)

    @property
    def num_sequences(self) -> int:
        return len(self.sequences)

    @property
    def path_tokens(self) -> int:
        """Sum of the sequence lengths (tokens a per-sequence trainer processes)."""
        return sum(len(sequence) for sequence in self.sequences)

    def forest(self) -> PrefixForest:
        """The prefix forest of the sequences, with their loss masks."""
        sequences = [np.asarray(sequence, dtype=np.int64) for sequence in self.sequences]
        masks = [np.asarray(mask, dtype=np.bool_) for mask in self.loss_masks]
        return PrefixForest.from_sequences(sequences, loss_masks=masks)


class SpanDrawer:
    """Random token spans and heavy-tailed span lengths from one seeded generator.

    Every span starts with the next id of one shuffled cycle through the vocabulary, so two spans share
    their first token only if the number of spans drawn between them is a multiple of ``vocab_size``;
    the other ids are uniform.
    """

    def __init__(self, rng: np.random.Generator, vocab_size: int):
        self.rng = rng
        self.vocab_size = vocab_size
        self._starts = rng.permutation(vocab_size)
        self._next_start = 0

    def tokens(self, length: int) -> np.ndarray:
        """``[length]`` int64 token ids (``length >= 1``)."""
        span = self.rng.integers(0, self.vocab_size, size=length, dtype=np.int64)
        span[0] = self._starts[self._next_start]
        self._next_start = (self._next_start + 1) % self.vocab_size
        return span

    def length(self, mean: float, sigma: float, max_factor: float) -> int:
        """A lognormal length with the given ``mean`` and log-space ``sigma``, clipped to ``max_factor * mean``
        and rounded, at least 1 (``sigma = 0`` gives ``round(mean)``)."""
        if sigma == 0:
            return max(1, round(mean))
        value = self.rng.lognormal(math.log(mean) - sigma * sigma / 2, sigma)
        return max(1, round(min(value, max_factor * mean)))

    def span(self, mean: float, sigma: float, max_factor: float) -> np.ndarray:
        """A span whose length is drawn by :meth:`length`."""
        return self.tokens(self.length(mean, sigma, max_factor))


class SequenceBuilder:
    """A sequence under construction: a list of ``(tokens, carries_loss)`` spans, cheap to copy and extend."""

    __slots__ = ("spans", "num_tokens")

    def __init__(self, spans: list[tuple[np.ndarray, bool]] | None = None):
        self.spans = list(spans or [])
        self.num_tokens = sum(len(tokens) for tokens, _ in self.spans)

    def add(self, tokens: np.ndarray, loss: bool) -> SequenceBuilder:
        self.spans.append((tokens, loss))
        self.num_tokens += len(tokens)
        return self

    def copy(self) -> SequenceBuilder:
        return SequenceBuilder(self.spans)

    def emit(self, sequences: list[list[int]], loss_masks: list[list[bool]], *extra: tuple[np.ndarray, bool]) -> None:
        """Append this sequence (followed by the ``extra`` spans, which are not kept) to the output lists."""
        spans = self.spans + list(extra)
        tokens = np.concatenate([span for span, _ in spans])
        flags = np.array([loss for _, loss in spans], dtype=np.bool_)
        mask = np.repeat(flags, [len(span) for span, _ in spans])
        sequences.append(tokens.tolist())
        loss_masks.append(mask.tolist())


# ---------------------------------------------------------------------- argument checks
def check_count(name: str, value, minimum: int = 1) -> int:
    """``value`` as an int >= ``minimum``, else ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} = {value!r}; expected an integer >= {minimum}.")
    return int(value)


def check_length(name: str, value, minimum: float = 1) -> float:
    """A (mean) token length: a finite number >= ``minimum``, else ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not math.isfinite(value) or value < minimum:
        raise ValueError(f"{name} = {value!r}; expected a token length >= {minimum}.")
    return float(value)


def check_probability(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not 0 <= value <= 1:
        raise ValueError(f"{name} = {value!r}; expected a probability in [0, 1].")
    return float(value)


def check_nonnegative(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} = {value!r}; expected a finite number >= 0.")
    return float(value)


def check_vocab_size(vocab_size) -> int:
    return check_count("vocab_size", vocab_size, minimum=2)
