"""PrefixForest / PackedForest against brute force on many random forests, plus bad input."""

import random

import numpy as np
import pytest
import torch

from harts_hf.trees import PrefixForest


def random_sequences(rng: random.Random, num_sequences: int, vocab: int = 5, max_len: int = 40):
    """Sequences that fork off earlier ones at random depths (and some fully random, some repeated)."""
    sequences = []
    for _ in range(num_sequences):
        kind = rng.random()
        if sequences and kind < 0.6:
            base = rng.choice(sequences)
            cut = rng.randint(0, len(base))
            tail = [rng.randrange(vocab) for _ in range(rng.randint(0 if cut else 1, max_len // 2))]
            sequences.append(base[:cut] + tail)
        elif sequences and kind < 0.7:
            sequences.append(list(rng.choice(sequences)))  # identical trajectory
        else:
            sequences.append([rng.randrange(vocab) for _ in range(rng.randint(1, max_len))])
    return sequences


def check_against_brute_force(sequences, loss_masks=None):
    packed = PrefixForest.from_sequences(sequences, loss_masks=loss_masks).pack()
    U = packed.num_tokens
    # every sequence comes back exactly, with depth positions and a parent chain
    prefix_of = {}
    for i, seq in enumerate(sequences):
        index = packed.sequence_index(i).tolist()
        assert packed.input_ids[index].tolist() == list(seq)
        assert packed.position_ids[index].tolist() == list(range(len(seq)))
        assert packed.parent[index].tolist() == [-1] + index[:-1]
        for j, t in enumerate(index):
            key = tuple(seq[: j + 1])
            assert prefix_of.setdefault(key, t) == t, "one prefix must map to one packed token"
    assert U == len(prefix_of), "unique tokens = distinct prefixes"
    # multiplicity counts sequences, duplicates included
    counts = [0] * U
    for i in range(len(sequences)):
        for t in packed.sequence_index(i).tolist():
            counts[t] += 1
    assert packed.multiplicity.tolist() == counts
    # ancestor test k <= q < subtree_end[k]  <=>  k on the parent chain of q (or q itself)
    parent = packed.parent.tolist()
    subtree_end = packed.subtree_end.tolist()
    for q in range(U):
        chain, t = set(), q
        while t >= 0:
            chain.add(t)
            t = parent[t]
        for k in range(U):
            assert (k <= q < subtree_end[k]) == (k in chain)
    # segments: a new segment starts at a root, after a branch point, or after a sequence end
    children = [0] * U
    for t in range(U):
        if parent[t] >= 0:
            children[parent[t]] += 1
    ends = {packed.sequence_index(i)[-1].item() for i in range(len(sequences))}
    starts = [t for t in range(U) if parent[t] < 0 or parent[t] != t - 1 or children[t - 1] >= 2 or (t - 1) in ends]
    cu = packed.cu_seqlens
    assert cu.dtype == torch.int32
    assert cu[:-1].tolist() == starts and cu[-1].item() == U
    segment_parent = packed.segment_parent.tolist()
    for s, start in enumerate(starts):
        p = parent[start]
        expected = -1 if p < 0 else max(i for i, b in enumerate(starts) if b <= p)
        assert segment_parent[s] == expected
    # loss counts
    if loss_masks is not None:
        loss = [0] * U
        for i, mask in enumerate(loss_masks):
            for t, m in zip(packed.sequence_index(i).tolist(), mask):
                loss[t] += int(m)
        assert packed.loss_count.tolist() == loss
        assert packed.loss_mask.tolist() == [x > 0 for x in loss]
    # statistics
    stats = packed.stats()
    lengths = [len(s) for s in sequences]
    assert stats["path_tokens"] == sum(lengths) and stats["unique_tokens"] == U
    assert stats["R_tok"] == pytest.approx(sum(lengths) / U)
    pairs = sum(n * (n + 1) // 2 for n in lengths)
    tree_pairs = sum(len(k) for k in prefix_of)
    assert stats["R_att"] == pytest.approx(pairs / tree_pairs)
    branch = [t for t in range(U) if children[t] >= 2]
    assert stats["branch_points"] == len(branch)
    assert stats["unaligned_branch_points"] == sum(1 for t in branch if (packed.position_ids[t].item() + 1) % 64)
    depth_segments = 0
    for i in range(len(sequences)):
        depth_segments = max(depth_segments, sum(1 for t in packed.sequence_index(i).tolist() if t in set(starts)))
    assert stats["depth_segments"] == depth_segments
    return packed


@pytest.mark.parametrize("seed", range(40))
def test_random_forests_match_brute_force(seed):
    rng = random.Random(seed)
    sequences = random_sequences(rng, rng.randint(1, 12), vocab=rng.choice([2, 3, 50]))
    masks = [[rng.random() < 0.5 for _ in s] for s in sequences] if seed % 2 else None
    check_against_brute_force(sequences, masks)


def test_special_shapes():
    check_against_brute_force([[3, 1, 4], [3, 1, 4], [3, 1, 4]])  # identical
    check_against_brute_force([[3], [3, 1], [3, 1, 4], [3, 1, 4, 1, 5]])  # each a prefix of the next
    check_against_brute_force([[3, 1, 4, 1, 5], [3, 1, 4], [3, 1], [3]])  # the same, longest first
    check_against_brute_force([[7], [8], [7]])  # single tokens
    check_against_brute_force([[0] * 10 + [k] for k in range(60)])  # one huge fan-out
    check_against_brute_force([list(range(200))])  # a deep chain
    check_against_brute_force([[1] * 70 + [2], [1] * 64 + [3], [1] * 128 + [4]])  # branches at 64 and 128


def test_tensor_inputs_and_helpers():
    sequences = [torch.tensor([5, 6, 7]), torch.tensor([5, 6, 8, 9], dtype=torch.int32), np.array([5, 1])]
    forest = PrefixForest.from_sequences(sequences)
    packed = forest.pack()
    assert forest.pack() is packed
    values = torch.randn(packed.num_tokens, 3, dtype=torch.float64, requires_grad=True)
    per_sequence = packed.gather_sequences(values)
    assert [v.shape[0] for v in per_sequence] == [3, 4, 2]
    padded, mask = packed.gather_padded(values, padding_value=-1.0)
    assert padded.shape == (3, 4, 3) and mask.sum().item() == 9
    assert (padded[~mask] == -1).all()
    for i, v in enumerate(per_sequence):
        assert torch.equal(padded[i, : v.shape[0]], v)
    # scatter is the adjoint of gather: <gather(x), y> == <x, scatter(y)>
    other = [torch.randn_like(v) for v in per_sequence]
    lhs = sum((v * o).sum() for v, o in zip(per_sequence, other))
    rhs = (values * packed.scatter_sequences(other)).sum()
    torch.testing.assert_close(lhs, rhs)
    other_padded = torch.zeros_like(padded)
    for i, o in enumerate(other):
        other_padded[i, : o.shape[0]] = o
    torch.testing.assert_close(packed.scatter_sequences(other_padded), packed.scatter_sequences(other))
    # ancestor table
    table = packed.ancestor_table(4)
    for t in range(packed.num_tokens):
        expected, a = [], t
        for _ in range(4):
            expected.append(a)
            a = packed.parent[a].item() if a >= 0 else -1
        assert table[t].tolist() == expected


@pytest.mark.parametrize(
    "sequences, loss_masks, error, words",
    [
        ([], None, ValueError, ["sequences is empty"]),
        ([[1, 2], []], None, ValueError, ["sequences[1]", "empty"]),
        ([[1, 2], [1.5]], None, TypeError, ["sequences[1][0]", "int"]),
        ([[1], torch.tensor([1.0, 2.0])], None, TypeError, ["sequences[1]", "dtype"]),
        ([[1], [2, -100]], None, ValueError, ["sequences[1][1]", "negative"]),
        ([torch.ones(2, 3, dtype=torch.long)], None, ValueError, ["sequences[0]", "1-D"]),
        (torch.ones(2, 3, dtype=torch.long), None, TypeError, ["list of 1-D"]),
        ([[1, 2], [3]], [[1, 0], [1, 1]], ValueError, ["loss_masks[1]", "length 2", "1 tokens"]),
        ([[1, 2]], [[1, 0], [1]], ValueError, ["loss_masks has 2 entries"]),
        ([[1, 2]], [[1, 3]], ValueError, ["loss_masks[0]", "0 and 1"]),
        ("abc", None, TypeError, ["sequences"]),
    ],
)
def test_bad_input(sequences, loss_masks, error, words):
    with pytest.raises(error) as info:
        PrefixForest.from_sequences(sequences, loss_masks=loss_masks)
    for word in words:
        assert word in str(info.value)


def test_build_is_linear_in_shared_prefix():
    # 64 trajectories sharing a 20k-token prefix: the shared span is compared in bulk, not per token
    prefix = list(np.random.default_rng(0).integers(0, 1000, 20000))
    sequences = [prefix + [1000 + k] * 5 for k in range(64)]
    stats = PrefixForest.from_sequences(sequences).stats()
    assert stats["unique_tokens"] == 20000 + 64 * 5
    assert stats["branch_points"] == 1


def test_groups_keep_trees_apart():
    sequences = [[1, 2, 3], [1, 2, 4], [1, 2, 3]]
    shared = PrefixForest.from_sequences(sequences).stats()
    apart = PrefixForest.from_sequences(sequences, groups=["a", "b", "a"]).stats()
    assert shared["unique_tokens"] == 4 and apart["unique_tokens"] == 6
    packed = PrefixForest.from_sequences(sequences, groups=["a", "b", "a"]).pack()
    for i, sequence in enumerate(sequences):
        assert packed.input_ids[packed.sequence_index(i)].tolist() == sequence
    with pytest.raises(ValueError, match="groups has 1 entries"):
        PrefixForest.from_sequences(sequences, groups=["a"])


def test_segment_tokens_and_select_take_the_same_tokens():
    """segment_tokens: the packed index of every token of the given segments, in order (checked against one arange
    per segment); select keeps exactly those tokens."""
    from tests.forests import random_tree_sequences

    packed = PrefixForest.from_sequences(random_tree_sequences(random.Random(0), 20, vocab=5, max_tail=50)).pack()
    cu = packed.cu_seqlens.tolist()
    for segments in ([0], list(range(packed.num_segments)), [1, 3, 4], [packed.num_segments - 1]):
        tokens = packed.segment_tokens(segments)
        assert tokens.tolist() == [t for s in segments for t in range(cu[s], cu[s + 1])]
        assert torch.equal(packed.select(segments).input_ids, packed.input_ids[tokens])


@pytest.mark.parametrize("max_tokens, align", [(40, 16), (40, 64), (7, 1), (1000, 16)])
def test_split_segments_cuts_long_runs_at_chunk_boundaries(max_tokens, align):
    """split_segments: every segment longer than ``max_tokens`` becomes a chain of single-child segments of at most
    that many tokens, cut at depths that are multiples of ``align`` where one lies inside the allowance; the tokens,
    their order and every token and sequence field stay; so do the branch points (the statistics but the segment
    count)."""
    from dataclasses import fields

    from tests.forests import random_tree_sequences

    packed = PrefixForest.from_sequences(random_tree_sequences(random.Random(1), 12, vocab=5, max_tail=120)).pack()
    split = packed.split_segments(max_tokens, align)
    lengths = split.cu_seqlens.diff().tolist()
    if max(packed.cu_seqlens.diff().tolist()) <= max_tokens:
        assert split is packed
        return
    assert max(lengths) <= max_tokens and split.num_segments > packed.num_segments
    for name in (f.name for f in fields(packed)):
        if name not in ("cu_seqlens", "segment_parent", "segment_depth", "_cache"):
            assert torch.equal(getattr(split, name), getattr(packed, name)), name
    assert set(packed.cu_seqlens.tolist()) <= set(split.cu_seqlens.tolist())  # the old boundaries stay
    old_starts = set(packed.cu_seqlens.tolist())
    depth = split.segment_depth.tolist()
    for s, (start, parent) in enumerate(zip(split.cu_seqlens.tolist()[:-1], split.segment_parent.tolist())):
        assert depth[s] == packed.position_ids[start]
        if start in old_starts:
            continue  # a segment as before (its parent: the last part of its old parent)
        assert parent == s - 1 and packed.parent[start] == start - 1  # a new cut: the previous part, one child
        aligned_inside = (depth[s - 1] + max_tokens) // align * align > depth[s - 1]
        assert depth[s] % align == 0 or not aligned_inside, (s, depth[s])
    # every token's segment parent chain is the token parent chain, segment by segment
    segment_of = split.segment_of_token()
    for s in range(split.num_segments):
        first = int(split.cu_seqlens[s])
        above = int(split.parent[first])
        assert split.segment_parent[s] == (-1 if above < 0 else segment_of[above])
    before, after = packed.stats(), split.stats()
    assert {k: v for k, v in before.items() if k not in ("segments", "depth_segments")} == \
        {k: v for k, v in after.items() if k not in ("segments", "depth_segments")}
    with pytest.raises(ValueError, match="max_tokens"):
        packed.split_segments(0)
