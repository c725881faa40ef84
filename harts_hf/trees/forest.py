"""Prefix forest: the radix trie of a batch of token sequences.

Shared prefixes are stored once; every sequence keeps its own identity (identical sequences are
two trajectories through the same tokens, a sequence that is a prefix of another ends inside it).
Building is linear in the input tokens: shared spans are compared with numpy, not token by token.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["PrefixForest"]

_MAX_TOKEN_ID = int(np.iinfo(np.int64).max)


class _Segment:
    """One edge of the radix trie: tokens ``arrays[source][start:end]`` at depths ``depth..``."""

    __slots__ = ("source", "start", "end", "depth", "parent", "children", "ends")

    def __init__(self, source: int, start: int, end: int, depth: int, parent: _Segment | None):
        self.source = source
        self.start = start
        self.end = end
        self.depth = depth
        self.parent = parent
        self.children: dict[int, _Segment] = {}
        self.ends: list[int] = []  # sequences whose last token is this segment's last token

    def __len__(self) -> int:
        return self.end - self.start


def _as_token_array(sequence, index: int) -> np.ndarray:
    if isinstance(sequence, torch.Tensor):
        if sequence.dim() != 1:
            raise ValueError(
                f"sequences[{index}] has shape {tuple(sequence.shape)}; expected a 1-D tensor of token ids "
                "(split a batch into a list of rows, dropping padding)."
            )
        if sequence.dtype.is_floating_point or sequence.dtype.is_complex or sequence.dtype == torch.bool:
            raise TypeError(f"sequences[{index}] has dtype {sequence.dtype}; expected an integer dtype (torch.long).")
        array = sequence.detach().cpu().numpy()
    elif isinstance(sequence, np.ndarray):
        if sequence.ndim != 1 or not np.issubdtype(sequence.dtype, np.integer):
            raise TypeError(
                f"sequences[{index}] is a numpy array of shape {sequence.shape} and dtype {sequence.dtype}; "
                "expected a 1-D integer array."
            )
        array = sequence
    elif isinstance(sequence, (list, tuple)):
        array = np.asarray(sequence) if len(sequence) else np.zeros(0, dtype=np.int64)
        if array.ndim != 1 or array.dtype.kind not in "iu":
            for position, token in enumerate(sequence):
                if isinstance(token, (bool, np.bool_)) or not isinstance(token, (int, np.integer)):
                    raise TypeError(
                        f"sequences[{index}][{position}] is {token!r} of type {type(token).__name__}; "
                        "expected an int token id."
                    )
            array = np.array([int(token) for token in sequence], dtype=object)  # exact, however large
    else:
        raise TypeError(
            f"sequences[{index}] is a {type(sequence).__name__}; expected a list of token ids or a 1-D integer tensor."
        )
    if array.size == 0:
        raise ValueError(f"sequences[{index}] is empty; every sequence needs at least one token.")
    if array.dtype == object or (array.dtype == np.uint64 and int(array.max()) > _MAX_TOKEN_ID):
        for position, token in enumerate(array.tolist()):  # exact python ints, before the cast wraps or overflows
            if not 0 <= token <= _MAX_TOKEN_ID:
                problem = "negative" if token < 0 else "too large"
                raise ValueError(f"sequences[{index}][{position}] = {token} is {problem}; token ids must be >= 0 and "
                                 "< 2**63 (remove padding such as -100 before building the forest).")
    array = array.astype(np.int64, copy=False)
    if array.min() < 0:
        position = int(np.argmax(array < 0))
        raise ValueError(
            f"sequences[{index}][{position}] = {int(array[position])} is negative; token ids must be >= 0 "
            "(remove padding such as -100 before building the forest)."
        )
    return array


def _as_loss_mask(mask, index: int, length: int) -> np.ndarray:
    if isinstance(mask, torch.Tensor):
        if mask.dim() != 1:
            raise ValueError(f"loss_masks[{index}] has shape {tuple(mask.shape)}; expected a 1-D tensor.")
        mask = mask.detach().cpu().numpy()
    mask = np.asarray(mask)
    if mask.ndim != 1:
        raise ValueError(f"loss_masks[{index}] has shape {mask.shape}; expected a 1-D mask.")
    if mask.shape[0] != length:
        raise ValueError(
            f"loss_masks[{index}] has length {mask.shape[0]} but sequences[{index}] has {length} tokens; "
            "give one mask entry per token."
        )
    if mask.dtype != np.bool_:
        if not (np.issubdtype(mask.dtype, np.integer) or np.issubdtype(mask.dtype, np.floating)):
            raise TypeError(f"loss_masks[{index}] has dtype {mask.dtype}; expected bool or 0/1 integers.")
        if not np.isin(mask, (0, 1)).all():
            raise ValueError(f"loss_masks[{index}] holds values other than 0 and 1; expected a 0/1 mask.")
        mask = mask.astype(np.bool_)
    return mask


class PrefixForest:
    """The radix trie of ``sequences``; build it with :meth:`from_sequences`, lay it out with :meth:`pack`."""

    def __init__(self, arrays: list[np.ndarray], loss_masks: list[np.ndarray] | None, roots: dict[int, _Segment]):
        self._arrays = arrays
        self._loss_masks = loss_masks
        self._roots = roots  # group -> first token -> root segment; a segment's ``ends`` name the sequences ending there
        self._packed = None

    @classmethod
    def from_sequences(cls, sequences: Sequence, *, loss_masks: Sequence | None = None,
                       groups: Sequence | None = None) -> PrefixForest:
        """Build the forest of ``sequences`` (token-id lists or 1-D integer tensors, any lengths >= 1).

        ``loss_masks`` (optional): one 0/1 or bool mask per sequence, as long as the sequence; it is
        carried to the packing (tokens that carry loss in at least one sequence).
        ``groups`` (optional): one hashable label per sequence; sequences of different groups never share
        tokens (separate trees), sequences of one group share their common prefixes.
        """
        if isinstance(sequences, torch.Tensor):
            raise TypeError(
                "sequences is a tensor; pass a list of 1-D token tensors (one per sequence, without padding)."
            )
        if not isinstance(sequences, Sequence) or isinstance(sequences, (str, bytes)):
            raise TypeError(f"sequences is a {type(sequences).__name__}; expected a list of token sequences.")
        if len(sequences) == 0:
            raise ValueError("sequences is empty; pass at least one token sequence.")
        arrays = [_as_token_array(sequence, index) for index, sequence in enumerate(sequences)]
        masks = None
        if loss_masks is not None:
            if len(loss_masks) != len(arrays):
                raise ValueError(
                    f"loss_masks has {len(loss_masks)} entries but sequences has {len(arrays)}; give one mask per sequence."
                )
            masks = [_as_loss_mask(mask, index, len(array)) for index, (mask, array) in enumerate(zip(loss_masks, arrays))]

        if isinstance(groups, (torch.Tensor, np.ndarray)):
            groups = groups.tolist()  # labels by value (a 0-d tensor hashes by identity: every row its own group)
        if groups is not None and len(groups) != len(arrays):
            raise ValueError(f"groups has {len(groups)} entries but sequences has {len(arrays)}; give one label per sequence.")
        for index, group in enumerate(() if groups is None else groups):
            try:
                hash(group)
            except TypeError:
                raise TypeError(f"from_sequences: groups[{index}] is {group!r:.80} of type {type(group).__name__}; "
                                "expected a hashable label (an int or a str) per sequence.") from None
        roots: dict = {}  # group label -> {first token -> root segment}
        for index, array in enumerate(arrays):
            group = None if groups is None else groups[index]
            _insert(roots.setdefault(group, {}), arrays, index, array)
        return cls(arrays, masks, roots)

    # ------------------------------------------------------------------ queries
    @property
    def num_sequences(self) -> int:
        return len(self._arrays)

    @property
    def sequence_lengths(self) -> list[int]:
        return [len(array) for array in self._arrays]

    def sequence(self, index: int) -> np.ndarray:
        return self._arrays[index]

    def loss_mask(self, index: int) -> np.ndarray | None:
        return None if self._loss_masks is None else self._loss_masks[index]

    def pack(self):
        """Lay the unique tokens out in depth-first order; see :class:`harts_hf.trees.PackedForest`."""
        if self._packed is None:
            from .packed import pack_forest

            self._packed = pack_forest(self)
        return self._packed

    def stats(self) -> dict:
        return self.pack().stats()


def _insert(roots: dict[int, _Segment], arrays: list[np.ndarray], index: int, array: np.ndarray) -> None:
    """Walk ``array`` down the trie, splitting a segment where it diverges, and record where it ends."""
    length = len(array)
    children, parent, position = roots, None, 0
    while True:
        segment = children.get(int(array[position]))
        if segment is None:
            segment = _Segment(index, position, length, position, parent)
            children[int(array[position])] = segment
            segment.ends.append(index)
            return
        span = min(len(segment), length - position)
        stored = arrays[segment.source][segment.start:segment.start + span]
        differ = np.flatnonzero(stored != array[position:position + span])
        common = int(differ[0]) if differ.size else span
        if common < len(segment):
            _split(segment, common, arrays)
        position += common
        if position == length:
            segment.ends.append(index)
            return
        children, parent = segment.children, segment


def _split(segment: _Segment, offset: int, arrays: list[np.ndarray]) -> None:
    """Cut ``segment`` after ``offset`` tokens; the tail keeps its children and ends."""
    tail = _Segment(segment.source, segment.start + offset, segment.end, segment.depth + offset, segment)
    tail.children, tail.ends = segment.children, segment.ends
    for child in tail.children.values():
        child.parent = tail
    segment.end = segment.start + offset
    segment.children = {int(arrays[tail.source][tail.start]): tail}
    segment.ends = []
