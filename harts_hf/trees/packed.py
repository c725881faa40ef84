"""PackedForest: the unique tokens of a prefix forest in one flat depth-first layout.

Everything a tree kernel needs is here as tensors: token ids, depth positions, parent pointers,
segment boundaries, subtree ends (ancestor test ``k <= q < subtree_end[k]``), multiplicities and
the gather index of every sequence. Built with numpy in time linear in the packed size.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np
import torch

from .._checks import check_int

__all__ = ["PackedForest", "pack_forest", "CHUNK_SIZE"]

CHUNK_SIZE = 64  # chunk length of chunkwise linear attention; branch points are counted against it


@dataclass
class PackedForest:
    """Unique tokens of a forest in depth-first (preorder) layout; ``U`` tokens, ``S`` segments, ``N`` sequences.

    Token fields (length ``U``): ``input_ids`` (long), ``position_ids`` (long, depth on the path, 0-based),
    ``parent`` (long, packed index of the previous token on every path through the token, -1 at a root),
    ``subtree_end`` (long, exclusive end of the token's subtree: q descends from k iff
    ``k <= q < subtree_end[k]``), ``multiplicity`` (long, number of sequences through the token),
    ``loss_mask`` (bool, the token carries loss in at least one sequence; all True without masks) and
    ``loss_count`` (long, number of sequences in which it carries loss).

    Segment fields (``S``): ``cu_seqlens`` (int32, ``S + 1`` boundaries; a segment is a maximal run with no
    branch and no sequence end inside), ``segment_parent`` (long, -1 for a root segment),
    ``segment_depth`` (long, depth of the segment's first token).

    Sequence fields (``N``): ``sequence_lengths`` (long) and ``sequence_offsets`` (long, ``N + 1``) into
    ``sequence_token_index`` (long, ``sum(lengths)``), the packed index of every token of every sequence.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    parent: torch.Tensor
    subtree_end: torch.Tensor
    multiplicity: torch.Tensor
    loss_mask: torch.Tensor
    loss_count: torch.Tensor
    cu_seqlens: torch.Tensor
    segment_parent: torch.Tensor
    segment_depth: torch.Tensor
    sequence_lengths: torch.Tensor
    sequence_offsets: torch.Tensor
    sequence_token_index: torch.Tensor
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    # ------------------------------------------------------------------ sizes
    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_segments(self) -> int:
        return self.cu_seqlens.shape[0] - 1

    @property
    def num_sequences(self) -> int:
        return self.sequence_lengths.shape[0]

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    def to(self, device) -> PackedForest:
        """A copy with every tensor on ``device`` (the cache of derived tables is dropped)."""
        values = {f.name: getattr(self, f.name).to(device) for f in fields(self) if f.name != "_cache"}
        return PackedForest(**values)

    def select(self, segments) -> PackedForest:
        """The sub-forest made of ``segments`` (packed segment ids, increasing), e.g. one planner piece.

        Tokens keep their order and their global depths (``position_ids``); a parent outside the selection
        becomes -1, so a piece cut out below a branch point has a root at depth > 0. Every sequence keeps
        its index; its entries are the tokens it has inside the selection (possibly none).
        """
        segments = np.asarray(segments, dtype=np.int64)
        if segments.ndim != 1 or segments.size == 0 or (np.diff(segments) <= 0).any():
            raise ValueError("select: segments must be a non-empty, strictly increasing list of segment ids")
        if segments[0] < 0 or segments[-1] >= self.num_segments:
            raise ValueError(f"select: segment ids must lie in [0, {self.num_segments}); got {segments.tolist()}")
        if self.device.type != "cpu":
            return self.to("cpu").select(segments).to(self.device)
        tokens = self.segment_tokens(segments).numpy()
        lengths = np.diff(self.cu_seqlens.numpy().astype(np.int64))[segments]
        local = np.full(self.num_tokens + 1, -1, dtype=np.int64)  # global -> local; entry -1 maps -1 to -1
        local[tokens] = np.arange(tokens.shape[0])
        local_segment = np.full(self.num_segments + 1, -1, dtype=np.int64)
        local_segment[segments] = np.arange(segments.shape[0])
        sequence_tokens = local[self.sequence_token_index.numpy()]
        inside = sequence_tokens >= 0
        sequence_of = np.repeat(np.arange(self.num_sequences), self.sequence_lengths.numpy())
        sequence_lengths = np.bincount(sequence_of[inside], minlength=self.num_sequences)
        sequence_offsets = np.zeros(self.num_sequences + 1, dtype=np.int64)
        np.cumsum(sequence_lengths, out=sequence_offsets[1:])
        cu_local = np.zeros(segments.shape[0] + 1, dtype=np.int64)
        np.cumsum(lengths, out=cu_local[1:])
        as_long = lambda array: torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64))  # noqa: E731
        index = torch.from_numpy(tokens)
        return PackedForest(
            input_ids=self.input_ids[index],
            position_ids=self.position_ids[index],
            parent=as_long(local[self.parent.numpy()[tokens]]),
            subtree_end=as_long(np.searchsorted(tokens, self.subtree_end.numpy()[tokens])),
            multiplicity=self.multiplicity[index],
            loss_mask=self.loss_mask[index],
            loss_count=self.loss_count[index],
            cu_seqlens=torch.from_numpy(cu_local.astype(np.int32)),
            segment_parent=as_long(local_segment[self.segment_parent.numpy()[segments]]),
            segment_depth=self.segment_depth[torch.from_numpy(segments)],
            sequence_lengths=as_long(sequence_lengths),
            sequence_offsets=as_long(sequence_offsets),
            sequence_token_index=as_long(sequence_tokens[inside]),
        )

    def split_segments(self, max_tokens: int, align: int = 1) -> PackedForest:
        """The same forest with every segment longer than ``max_tokens`` cut into consecutive segments of at most
        ``max_tokens`` tokens, each the single child of the one before (as a sequence that ends inside a segment
        cuts it), so that a planner piece can end inside a long run. The cuts lie at depths that are multiples of
        ``align`` (a chunk boundary: the state handed across needs no replay) where ``max_tokens >= align``.
        Tokens, their order and every token and sequence field stay as they are; ``self`` if no segment is longer."""
        max_tokens = check_int(max_tokens, "PackedForest.split_segments: max_tokens")
        align = check_int(align, "PackedForest.split_segments: align")
        cu = self.cu_seqlens.cpu().numpy().astype(np.int64)
        if int(np.diff(cu).max()) <= max_tokens:
            return self
        depth0 = self.segment_depth.cpu().numpy()
        parent = self.segment_parent.cpu().numpy()
        new_cu, new_parent, new_depth = [0], [], []
        last = np.empty(self.num_segments, dtype=np.int64)  # the new id of each segment's last part
        for s in range(self.num_segments):  # preorder: a parent's parts are numbered before its children's
            start, end, previous = int(cu[s]), int(cu[s + 1]), (int(last[parent[s]]) if parent[s] >= 0 else -1)
            position = start
            while position < end:
                depth = int(depth0[s]) + position - start
                cut_depth = depth + max_tokens
                if end - position > max_tokens and cut_depth // align * align > depth:
                    cut_depth = cut_depth // align * align
                cut = min(end, position + cut_depth - depth)
                new_parent.append(previous)
                new_depth.append(depth)
                new_cu.append(cut)
                previous, position = len(new_parent) - 1, cut
            last[s] = previous
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "_cache"}
        device = self.device
        values.update(cu_seqlens=torch.tensor(new_cu, dtype=torch.int32, device=device),
                      segment_parent=torch.tensor(new_parent, dtype=torch.long, device=device),
                      segment_depth=torch.tensor(new_depth, dtype=torch.long, device=device))
        return PackedForest(**values)

    def segment_tokens(self, segments) -> torch.Tensor:
        """``[T]`` long on the CPU: the packed index of every token of ``segments`` (segment ids), in their order."""
        cu = self.cu_seqlens.cpu().numpy().astype(np.int64)
        segments = np.asarray(segments, dtype=np.int64)
        lengths = cu[segments + 1] - cu[segments]
        starts = cu[segments] - (np.cumsum(lengths) - lengths)  # a segment's first token minus its offset in the result
        return torch.from_numpy(np.repeat(starts, lengths) + np.arange(int(lengths.sum())))

    # ------------------------------------------------------------------ sequences
    def sequence_index(self, i: int) -> torch.Tensor:
        """Packed index ``[L_i]`` of every token of sequence ``i``, in order."""
        if not -self.num_sequences <= i < self.num_sequences:
            raise IndexError(f"sequence index {i} out of range for {self.num_sequences} sequences")
        i = i % self.num_sequences
        start, end = self.sequence_offsets[i].item(), self.sequence_offsets[i + 1].item()
        return self.sequence_token_index[start:end]

    def gather_sequences(self, values: torch.Tensor) -> list[torch.Tensor]:
        """Split per-token ``values [U, ...]`` into one tensor ``[L_i, ...]`` per sequence (differentiable)."""
        self._check_token_values(values)
        flat = values.index_select(0, self.sequence_token_index)
        return list(flat.split(self.sequence_lengths.tolist()))

    def gather_padded(self, values: torch.Tensor, padding_value: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token ``values [U, ...]`` as ``[N, L_max, ...]`` plus a bool mask ``[N, L_max]`` of real positions."""
        self._check_token_values(values)
        rows, columns = self._padded_coordinates()
        length = int(self.sequence_lengths.max())
        out = values.new_full((self.num_sequences, length, *values.shape[1:]), padding_value)
        out = out.index_put((rows, columns), values.index_select(0, self.sequence_token_index))
        mask = torch.zeros(self.num_sequences, length, dtype=torch.bool, device=values.device)
        mask[rows, columns] = True
        return out, mask

    def scatter_sequences(self, values) -> torch.Tensor:
        """Sum per-sequence values back onto the unique tokens: the adjoint of :meth:`gather_sequences`.

        ``values`` is a list of ``[L_i, ...]`` tensors, or a padded ``[N, L_max, ...]`` tensor (padding ignored).
        Returns ``[U, ...]``; a token shared by k sequences receives the sum of their k values.
        """
        if isinstance(values, (list, tuple)):
            if len(values) != self.num_sequences:
                raise ValueError(f"values has {len(values)} entries; expected one per sequence ({self.num_sequences}).")
            for i, (value, length) in enumerate(zip(values, self.sequence_lengths.tolist())):
                if value.shape[0] != length:
                    raise ValueError(f"values[{i}] has {value.shape[0]} rows; sequence {i} has {length} tokens.")
            flat = torch.cat(list(values), 0)
        else:
            if values.dim() < 2 or values.shape[0] != self.num_sequences or values.shape[1] < int(self.sequence_lengths.max()):
                raise ValueError(
                    f"values has shape {tuple(values.shape)}; expected [{self.num_sequences}, >= "
                    f"{int(self.sequence_lengths.max())}, ...] (one padded row per sequence)."
                )
            rows, columns = self._padded_coordinates()
            flat = values[rows, columns]
        out = flat.new_zeros((self.num_tokens, *flat.shape[1:]))
        return out.index_add(0, self.sequence_token_index, flat)

    def _padded_coordinates(self) -> tuple[torch.Tensor, torch.Tensor]:
        if "padded" not in self._cache:
            lengths = self.sequence_lengths
            rows = torch.repeat_interleave(torch.arange(self.num_sequences, device=self.device), lengths)
            columns = torch.arange(rows.shape[0], device=self.device) - self.sequence_offsets[:-1].repeat_interleave(lengths)
            self._cache["padded"] = (rows, columns)
        return self._cache["padded"]

    def _check_token_values(self, values: torch.Tensor) -> None:
        if values.shape[0] != self.num_tokens:
            raise ValueError(f"values has {values.shape[0]} rows; expected one per packed token ({self.num_tokens}).")

    # ------------------------------------------------------------------ derived tables
    def ancestor_table(self, width: int, context_rows: int = 0) -> torch.Tensor:
        """``[U, width]`` long: column j holds the j-th ancestor of every token (0 = itself), -1 past a root.

        ``context_rows = M``: every root of the forest sits at depth ``d0`` below the same ``M`` ancestors outside
        it (sibling subtrees cut below one branch token), rows ``U .. U + M - 1`` (depths ``d0 - M .. d0 - 1``);
        ancestors there get those row numbers.
        """
        key = ("ancestors", width, context_rows)
        if key not in self._cache:
            table = torch.empty(self.num_tokens, width, dtype=torch.long, device=self.device)
            current = torch.arange(self.num_tokens, device=self.device)
            for j in range(width):
                table[:, j] = current
                current = torch.where(current >= 0, self.parent[current.clamp_min(0)], current)
            if context_rows:
                roots = torch.nonzero(self.parent < 0).squeeze(1)
                depths = self.position_ids[roots]
                if bool((depths != depths[0]).any()):
                    raise ValueError(f"ancestor_table: context rows need every root at one depth (siblings below one "
                                     f"branch token), got roots at depths {sorted(set(depths.tolist()))}")
                first = int(depths[0]) - context_rows  # depth of context row 0
                if first < 0:
                    raise ValueError(f"ancestor_table: {context_rows} context rows but the root has only "
                                     f"{first + context_rows} ancestors")
                depth = self.position_ids[:, None] - torch.arange(width, device=self.device)
                outside = (table < 0) & (depth >= first)
                table = torch.where(outside, self.num_tokens + depth - first, table)
            self._cache[key] = table
        return self._cache[key]

    def segment_of_token(self) -> torch.Tensor:
        """``[U]`` long: the segment holding every token."""
        if "segment_of_token" not in self._cache:
            lengths = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).long()
            self._cache["segment_of_token"] = torch.repeat_interleave(
                torch.arange(self.num_segments, device=self.device), lengths)
        return self._cache["segment_of_token"]

    # ------------------------------------------------------------------ statistics
    def stats(self, chunk_size: int = CHUNK_SIZE) -> dict:
        """Workload statistics of the forest (plain python numbers).

        ``path_tokens`` = sum of sequence lengths; ``R_tok`` = path / unique tokens; ``R_att`` = attention pairs of
        per-sequence causal attention (sum L(L+1)/2) over tree pairs (sum over unique tokens of depth + 1);
        ``depth_segments`` = most segments on one root-to-end path; ``branch_points`` = tokens with two or more
        children; ``unaligned_branch_points`` = those whose children do not start on a ``chunk_size`` boundary.
        """
        chunk_size = check_int(chunk_size, "PackedForest.stats: chunk_size")
        if self.device.type != "cpu":
            return self.to("cpu").stats(chunk_size)
        lengths = self.sequence_lengths.double()
        path_tokens = int(self.sequence_lengths.sum())
        unique = self.num_tokens
        path_pairs = float((lengths * (lengths + 1) / 2).sum())
        tree_pairs = float((self.position_ids.double() + 1).sum())
        children = torch.bincount(self.segment_parent[self.segment_parent >= 0], minlength=self.num_segments)
        branching = children >= 2
        segment_ends = self.segment_depth + (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).long()
        depth = torch.ones(self.num_segments, dtype=torch.long)
        parents = self.segment_parent.cpu().tolist()
        depth_list = depth.tolist()
        for s, p in enumerate(parents):  # preorder: a parent comes before its children
            if p >= 0:
                depth_list[s] = depth_list[p] + 1
        return {
            "sequences": self.num_sequences,
            "path_tokens": path_tokens,
            "unique_tokens": unique,
            "R_tok": path_tokens / unique,
            "path_attention_pairs": path_pairs,
            "tree_attention_pairs": tree_pairs,
            "R_att": path_pairs / tree_pairs,
            "segments": self.num_segments,
            "depth_segments": max(depth_list),
            "max_depth": int(self.position_ids.max()) + 1,
            "branch_points": int(branching.sum()),
            "unaligned_branch_points": int((branching & (segment_ends.cpu() % chunk_size != 0)).sum()),
        }


def pack_forest(forest) -> PackedForest:
    """Lay out ``forest`` (a :class:`PrefixForest`) in depth-first preorder; children in insertion order."""
    arrays = forest._arrays
    order, parent_of = [], []
    roots = [root for group in forest._roots.values() for root in group.values()]
    stack = [(root, -1) for root in reversed(roots)]
    while stack:
        segment, parent_index = stack.pop()
        index = len(order)
        order.append(segment)
        parent_of.append(parent_index)
        stack.extend((child, index) for child in reversed(list(segment.children.values())))

    num_segments = len(order)
    segment_parent = np.asarray(parent_of, dtype=np.int64)
    lengths = np.fromiter((len(s) for s in order), dtype=np.int64, count=num_segments)
    segment_depth = np.fromiter((s.depth for s in order), dtype=np.int64, count=num_segments)
    cu = np.zeros(num_segments + 1, dtype=np.int64)
    np.cumsum(lengths, out=cu[1:])
    num_tokens = int(cu[-1])

    # subtree sizes (in segments) and multiplicities, children before parents
    subtree_segments = np.ones(num_segments, dtype=np.int64)
    multiplicity = np.fromiter((len(s.ends) for s in order), dtype=np.int64, count=num_segments)
    for s in range(num_segments - 1, 0, -1):
        p = parent_of[s]
        if p >= 0:
            subtree_segments[p] += subtree_segments[s]
            multiplicity[p] += multiplicity[s]
    segment_subtree_end = cu[np.arange(num_segments) + subtree_segments]

    segment_of_token = np.repeat(np.arange(num_segments), lengths)
    offset_in_segment = np.arange(num_tokens) - cu[:-1][segment_of_token]
    input_ids = np.concatenate([arrays[s.source][s.start:s.end] for s in order])
    position_ids = segment_depth[segment_of_token] + offset_in_segment
    parent = np.arange(num_tokens) - 1
    has_parent = segment_parent >= 0
    parent[cu[:-1]] = np.where(has_parent, cu[np.maximum(segment_parent, 0) + 1] - 1, -1)

    # every sequence: the chain of segments from its root to the segment where it ends
    num_sequences = forest.num_sequences
    end_segment = np.empty(num_sequences, dtype=np.int64)
    for index, segment in enumerate(order):
        for sequence in segment.ends:
            end_segment[sequence] = index
    path_segments, path_counts = [], np.empty(num_sequences, dtype=np.int64)
    for i in range(num_sequences):
        chain, s = [], int(end_segment[i])
        while s >= 0:
            chain.append(s)
            s = parent_of[s]
        chain.reverse()
        path_segments.extend(chain)
        path_counts[i] = len(chain)
    path_segments = np.asarray(path_segments, dtype=np.int64)
    run_lengths = lengths[path_segments]
    run_starts = cu[:-1][path_segments]
    total = int(run_lengths.sum())
    run_offsets = np.zeros(len(run_lengths) + 1, dtype=np.int64)
    np.cumsum(run_lengths, out=run_offsets[1:])
    token_index = np.arange(total) - np.repeat(run_offsets[:-1] - run_starts, run_lengths)
    sequence_lengths = np.asarray(forest.sequence_lengths, dtype=np.int64)
    sequence_offsets = np.zeros(num_sequences + 1, dtype=np.int64)
    np.cumsum(sequence_lengths, out=sequence_offsets[1:])

    if forest._loss_masks is None:
        loss_count = multiplicity[segment_of_token].copy()
    else:
        all_masks = np.concatenate(forest._loss_masks).astype(np.int64)
        loss_count = np.bincount(token_index, weights=all_masks, minlength=num_tokens).astype(np.int64)

    as_long = lambda array: torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64))  # noqa: E731
    return PackedForest(
        input_ids=as_long(input_ids),
        position_ids=as_long(position_ids),
        parent=as_long(parent),
        subtree_end=as_long(segment_subtree_end[segment_of_token]),
        multiplicity=as_long(multiplicity[segment_of_token]),
        loss_mask=torch.from_numpy(loss_count > 0),
        loss_count=as_long(loss_count),
        cu_seqlens=torch.from_numpy(cu.astype(np.int32)),
        segment_parent=as_long(segment_parent),
        segment_depth=as_long(segment_depth),
        sequence_lengths=as_long(sequence_lengths),
        sequence_offsets=as_long(sequence_offsets),
        sequence_token_index=as_long(token_index),
    )
