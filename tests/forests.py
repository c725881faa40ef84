"""Token-sequence forests shared by the kernel and model tests (branch points at every chunk offset that matters)."""

import random


def chunk_edge_sequences(vocab: int = 97, seed: int = 0, base_len: int = 300):
    """Sequences forking off one base path at depths 0, 1, 63, 64, 65, 127, 128, 129 and > 128, with nested
    forks, one-token branches, an identical pair and a sequence that is a prefix of another."""
    rng = random.Random(seed)
    base = [rng.randrange(vocab) for _ in range(base_len)]

    def tail(n):
        return [rng.randrange(vocab) for _ in range(n)]

    sequences = [base, list(base), base[:129]]  # identical pair, a prefix ending mid-path
    for depth, length in [(0, 5), (1, 70), (63, 1), (64, 20), (65, 64), (127, 3), (128, 1), (129, 66), (200, 40)]:
        sequences.append(base[:depth] + tail(length) if depth else tail(length))
    nested = base[:70] + tail(100)  # a branch that branches again inside its own chunks
    sequences += [nested, nested[:130] + tail(10), nested[:64] + tail(2), nested[:71] + tail(1)]
    return sequences


def random_tree_sequences(rng: random.Random, num_sequences: int, vocab: int = 11, max_tail: int = 90):
    """Random forks of earlier sequences at random depths (plus fresh roots and repeats)."""
    sequences = [[rng.randrange(vocab) for _ in range(rng.randint(1, max_tail))]]
    while len(sequences) < num_sequences:
        roll = rng.random()
        if roll < 0.75:
            base = rng.choice(sequences)
            cut = rng.randint(0, len(base))
            sequences.append(base[:cut] + [rng.randrange(vocab) for _ in range(rng.randint(0 if cut else 1, max_tail))])
        elif roll < 0.85:
            sequences.append(list(rng.choice(sequences)))
        else:
            sequences.append([rng.randrange(vocab) for _ in range(rng.randint(1, max_tail))])
    return sequences
