"""plan(): cut a generation batch's prefix forest into pieces that fit a token budget, then place the pieces
in microbatches, data-parallel replicas and gradient-accumulation slots.

A piece is a subtree of the segment tree minus the child subtrees cut off into pieces of their own. Cuts
happen only where a subtree does not fit (largest children first, bottom-up), so a subtree that fits is
never split and no prefix token is computed twice: a cut-off piece receives its ancestors' keys/values and
the linear-attention state at its chunk boundary from the piece that holds them (its ``handoff``). Cut
subtrees below the same branch token (e.g. the completions of one prompt) share that hand-off, so they are
packed together into pieces of up to the budget (several roots, one forward). Pieces
are placed by longest-processing-time first (whole trees with ``cross_replica=False``); on each replica they
run in depth-first order, so a source piece runs before its children there.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from .._checks import check_bool, check_int
from ..trees import CHUNK_SIZE, PackedForest, PrefixForest
from .cost import CostModel

__all__ = ["Handoff", "Microbatch", "Piece", "Plan", "plan"]


@dataclass(frozen=True)
class Handoff:
    """What a cut-off piece receives: from ``source_piece``, the keys/values of the ``ancestor_tokens`` tokens on
    its root path (ending at packed token ``branch_token``) and the linear-attention state at depth
    ``state_depth`` (a chunk boundary), after which it replays ``replay_tokens`` ancestor tokens."""

    source_piece: int
    branch_token: int
    ancestor_tokens: int
    state_depth: int
    replay_tokens: int


@dataclass
class Piece:
    """Segments (packed segment ids, preorder) computed together, in one forward; ``tree`` is the index of its root
    tree (the first, when whole trees sharing a microbatch were merged into one piece)."""

    index: int
    segments: list[int]
    tree: int
    handoff: Handoff | None
    features: dict
    cost: float

    @property
    def unique_tokens(self) -> int:
        return int(self.features["unique_tokens"])


@dataclass
class Microbatch:
    """Pieces of one gradient-accumulation slot (empty in padding slots); whole trees placed together are one
    piece, so one forward+backward (a piece handed a context, or handing one on, runs as its own)."""

    pieces: list[int] = field(default_factory=list)
    unique_tokens: int = 0
    cost: float = 0.0


@dataclass
class Plan:
    """``replicas[r][slot]``: the microbatch replica ``r`` runs in gradient-accumulation slot ``slot``; every
    replica has ``num_slots`` slots."""

    pieces: list[Piece]
    replicas: list[list[Microbatch]]
    token_budget: int
    cost_model: CostModel
    packed: PackedForest

    @property
    def num_slots(self) -> int:
        return len(self.replicas[0])

    def replica_costs(self) -> list[float]:
        return [sum(mb.cost for mb in slots) for slots in self.replicas]

    def replica_of_piece(self) -> dict[int, int]:
        return {piece: r for r, slots in enumerate(self.replicas) for mb in slots for piece in mb.pieces}

    def cross_replica_handoffs(self) -> int:
        where = self.replica_of_piece()
        return sum(p.handoff is not None and where[p.handoff.source_piece] != where[p.index] for p in self.pieces)

    def stats(self) -> dict:
        costs = self.replica_costs()
        mean = sum(costs) / len(costs)
        return {
            "pieces": len(self.pieces),
            "handoffs": sum(p.handoff is not None for p in self.pieces),
            "cross_replica_handoffs": self.cross_replica_handoffs(),
            "slots": self.num_slots,
            "max_replica_cost": max(costs),
            "mean_replica_cost": mean,
            "imbalance": max(costs) / mean if mean > 0 else 1.0,
            "duplicated_tokens": 0,  # every unique token lives in exactly one piece
            "unique_tokens": sum(p.unique_tokens for p in self.pieces),
        }


def _as_packed(forest_or_sequences) -> PackedForest:
    if isinstance(forest_or_sequences, PackedForest):
        return forest_or_sequences
    if isinstance(forest_or_sequences, PrefixForest):
        return forest_or_sequences.pack()
    return PrefixForest.from_sequences(forest_or_sequences).pack()


def plan(forest_or_sequences, *, num_replicas: int = 1, token_budget: int, cost_model: CostModel | None = None,
         chunk_size: int = CHUNK_SIZE, cross_replica: bool = True, pieces_per_replica: int | None = None) -> Plan:
    """Plan a generation batch.

    Args:
        forest_or_sequences: a :class:`PrefixForest`, its :class:`PackedForest`, or token sequences.
        num_replicas: data-parallel replicas (>= 1).
        token_budget: most unique tokens in one microbatch (>= 1).
        cost_model: coefficients of the cost of a piece (:class:`CostModel` defaults if None).
        chunk_size: chunk length of the linear-attention kernels (restart boundaries).
        pieces_per_replica: with ``cross_replica`` and several replicas, also cut subtrees larger than
            ``unique / (num_replicas * pieces_per_replica)`` tokens (never below the longest unbranched run), so
            placement can balance: hand-offs instead of imbalance, still no token computed twice. 0 cuts only
            what exceeds the budget. None (the default): plan with 0, 1, 2 and 4 and keep the plan whose slowest
            replica the cost model prices lowest (the fewest pieces on a tie): every piece is a forward+backward
            call of its own with the model's fixed cost, so finer cuts balance better but cost more.
        cross_replica: place pieces independently (a hand-off may cross replicas: a batch whose tasks share one
            system prompt is a single tree); False keeps every tree on one replica.

    Returns:
        A :class:`Plan`; deterministic for the same input. A run of tokens without a branch point (part of one
        trajectory) longer than ``token_budget`` is cut at chunk boundaries into segments that fit
        (:meth:`PackedForest.split_segments`): the plan's ``packed`` then has those segments (the same tokens in
        the same order), and its pieces name them.
    """
    num_replicas = check_int(num_replicas, "plan: num_replicas")
    token_budget = check_int(token_budget, "plan: token_budget")
    chunk_size = check_int(chunk_size, "plan: chunk_size")
    if pieces_per_replica is not None:
        pieces_per_replica = check_int(pieces_per_replica, "plan: pieces_per_replica", minimum=0)
    cross_replica = check_bool(cross_replica, "plan: cross_replica")
    if cost_model is not None and not isinstance(cost_model, CostModel):
        raise TypeError(f"plan: cost_model must be a CostModel or None, got {type(cost_model).__name__}")
    cost_model = cost_model or CostModel()
    # a run longer than the budget is cut inside, at chunk boundaries: its parts hand over as at a branch point
    packed = _as_packed(forest_or_sequences).split_segments(token_budget, chunk_size)
    cu = packed.cu_seqlens.cpu().numpy().astype(np.int64)
    lengths = cu[1:] - cu[:-1]
    parent = packed.segment_parent.cpu().numpy()
    depth0 = packed.segment_depth.cpu().numpy()
    num_segments = lengths.shape[0]
    children: list[list[int]] = [[] for _ in range(num_segments)]
    for s in range(num_segments):
        if parent[s] >= 0:
            children[parent[s]].append(s)

    shared = dict(packed=packed, cu=cu, lengths=lengths, parent=parent, depth0=depth0, children=children,
                  token_budget=token_budget, chunk_size=chunk_size, cost_model=cost_model, num_replicas=num_replicas,
                  cross_replica=cross_replica)
    if not (cross_replica and num_replicas > 1):
        return _cut_and_place(token_budget, **shared)
    cut_sizes = []  # the largest subtree kept whole, per pieces-per-replica choice (a size once)
    for per_replica in [0, 1, 2, 4] if pieces_per_replica is None else [pieces_per_replica]:
        target = -(-int(lengths.sum()) // (num_replicas * per_replica)) if per_replica else token_budget
        cut_size = min(token_budget, max(target, int(lengths.max())))
        if cut_size not in cut_sizes:
            cut_sizes.append(cut_size)
    plans = [_cut_and_place(cut_size, **shared) for cut_size in cut_sizes]
    return min(plans, key=lambda the_plan: (round(max(the_plan.replica_costs()), 9), len(the_plan.pieces)))


def _cut_and_place(cut_size: int, *, packed, cu, lengths, parent, depth0, children, token_budget, chunk_size,
                   cost_model, num_replicas, cross_replica) -> Plan:
    """The plan whose pieces keep subtrees of at most ``cut_size`` unique tokens whole (see :func:`plan`)."""
    num_segments = lengths.shape[0]
    # bottom-up: keep children while the subtree fits, cut the largest kept children first otherwise
    kept_size = lengths.copy()
    cut = np.zeros(num_segments, dtype=bool)
    for s in range(num_segments - 1, -1, -1):  # reverse preorder: children before parents
        sizes = sorted(((int(kept_size[c]), -c) for c in children[s]), reverse=True)
        total = int(lengths[s]) + sum(size for size, _ in sizes)
        for size, negative_child in sizes:
            if total <= cut_size:
                break
            cut[-negative_child] = True
            total -= size
        kept_size[s] = total

    # cut children of one segment fork at the same branch token, so they share one hand-off: pack them into as few
    # pieces as fit (first fit, largest first) instead of one forward each. Not when pieces are placed one by one
    # on several replicas: there the small pieces are what balances the replicas.
    pack_siblings = not (cross_replica and num_replicas > 1)
    bin_of: dict[int, tuple[int, int]] = {}
    for s in range(num_segments):
        bins: list[int] = []
        for size, c in sorted(((int(kept_size[c]), c) for c in children[s] if cut[c]), key=lambda x: (-x[0], x[1])):
            slot = next((i for i, used in enumerate(bins) if pack_siblings and used + size <= cut_size), len(bins))
            if slot == len(bins):
                bins.append(0)
            bins[slot] += size
            bin_of[c] = (s, slot)

    # pieces in preorder; every segment joins the piece of its nearest cut (or root) ancestor
    ends_per_segment = np.bincount(packed.segment_of_token()[packed.sequence_token_index[
        packed.sequence_offsets[1:] - 1]].cpu().numpy(), minlength=num_segments)
    piece_of = np.empty(num_segments, dtype=np.int64)
    tree_of = np.empty(num_segments, dtype=np.int64)
    members: list[list[int]] = []
    piece_of_bin: dict[tuple[int, int], int] = {}
    tree_count = 0
    for s in range(num_segments):
        if parent[s] < 0:
            tree_of[s] = tree_count
            tree_count += 1
        else:
            tree_of[s] = tree_of[parent[s]]
        if parent[s] < 0 or (cut[s] and bin_of[s] not in piece_of_bin):
            piece_of[s] = len(members)
            members.append([])
            if parent[s] >= 0:
                piece_of_bin[bin_of[s]] = piece_of[s]
        elif cut[s]:
            piece_of[s] = piece_of_bin[bin_of[s]]
        else:
            piece_of[s] = piece_of[parent[s]]
        members[piece_of[s]].append(s)

    pieces = []
    for index, segments in enumerate(members):
        root = segments[0]
        # subtrees below ONE branch token: every root of the piece has the same root path, the one hand-off carries
        assert all(piece_of[parent[s]] == index or (cut[s] and parent[s] == parent[root]) for s in segments[1:]), \
            f"piece {index} has roots below different branch tokens"
        handoff = None
        if parent[root] >= 0:
            start = int(depth0[root])
            boundary = (start // chunk_size) * chunk_size
            handoff = Handoff(int(piece_of[parent[root]]), int(cu[parent[root] + 1] - 1), start, boundary,
                              start - boundary)
        features = _piece_features(segments, lengths, depth0, parent, children, ends_per_segment, chunk_size, handoff)
        pieces.append(Piece(index, segments, int(tree_of[root]), handoff, features, cost_model.cost(features)))

    replicas = _place(pieces, num_replicas, token_budget, cost_model, cross_replica)
    pieces, replicas = _merge_whole_trees(pieces, replicas, cost_model)
    return Plan(pieces, replicas, token_budget, cost_model, packed)


def _merge_whole_trees(pieces: list[Piece], replicas: list[list[Microbatch]],
                       cost_model: CostModel) -> tuple[list[Piece], list[list[Microbatch]]]:
    """Whole trees (no hand-off in or out) placed in the same microbatch become ONE piece, so the executor runs
    them in one forward and backward (one piece is one forward): without this, every small tree of a microbatch
    paid a forward's fixed cost of its own. The merged piece takes its first tree's place in the (preorder) piece
    order; indices are renumbered throughout."""
    own_call = _runs_alone(pieces)
    first_of: dict[int, int] = {}  # merged piece -> the piece it joins
    for slots in replicas:
        for microbatch in slots:
            whole = [i for i in microbatch.pieces if not own_call[i]]
            first_of.update((i, whole[0]) for i in whole[1:])
    if not first_of:
        return pieces, replicas
    kept = [p for p in pieces if p.index not in first_of]
    new_index = {p.index: i for i, p in enumerate(kept)}
    new_index.update((i, new_index[first]) for i, first in first_of.items())
    groups: dict[int, list[Piece]] = {}
    for p in pieces:
        groups.setdefault(new_index[p.index], []).append(p)
    merged = []
    for i, p in enumerate(kept):
        group = groups[i]
        handoff = p.handoff if p.handoff is None else replace(p.handoff, source_piece=new_index[p.handoff.source_piece])
        features = p.features if len(group) == 1 else {
            key: max(q.features[key] for q in group) if key == "rounds" else sum(q.features[key] for q in group)
            for key in p.features}
        merged.append(Piece(i, sorted(s for q in group for s in q.segments), p.tree, handoff, features,
                            p.cost if len(group) == 1 else cost_model.cost(features)))
    renumbered = []
    for slots in replicas:
        renumbered.append([])
        for microbatch in slots:
            indices = sorted({new_index[i] for i in microbatch.pieces})
            cost = sum(merged[i].cost for i in indices) + cost_model.cost({"microbatches": len(indices)})
            renumbered[-1].append(Microbatch(indices, microbatch.unique_tokens, cost))
    return merged, renumbered


def _runs_alone(pieces: list[Piece]) -> list[bool]:
    """Per piece: True where the executor runs it as a forward+backward of its own (it is handed a context, or hands
    one on); False for a whole tree, which shares one call with the other whole trees of its microbatch. The cost
    model's fixed cost (``microbatches``) is paid once per call."""
    sources = {p.handoff.source_piece for p in pieces if p.handoff is not None}
    return [p.handoff is not None or p.index in sources for p in pieces]


def _piece_features(segments, lengths, depth0, parent, children, ends, chunk_size, handoff) -> dict:
    """Work of one piece: tokens, attention pairs against the whole root path, replay and rounds of its runs."""
    in_piece = set(segments)
    unique = pairs = replay = 0
    rounds_of: dict[int, int] = {}
    for s in segments:  # preorder
        n, d = int(lengths[s]), int(depth0[s])
        unique += n
        pairs += n * d + n * (n + 1) // 2
        p = parent[s]
        first_child = p >= 0 and p in in_piece and children[p][0] == s
        if p < 0 or first_child:
            rounds_of[s] = rounds_of.get(p, 1) if p >= 0 else 1  # continues its parent's run
        else:
            replay += d % chunk_size  # a new run restarts at its chunk boundary
            rounds_of[s] = rounds_of.get(p, 0) + 1
    return {"unique_tokens": unique, "attention_pairs": pairs, "replay_tokens": replay,
            "rounds": max(rounds_of.values()), "leaves": int(sum(ends[s] for s in segments)), "microbatches": 0}


def _place(pieces: list[Piece], num_replicas: int, token_budget: int, cost_model: CostModel,
           cross_replica: bool) -> list[list[Microbatch]]:
    """Units (pieces, or whole trees) to replicas by longest-processing-time first, then a local search on each
    replica's cost as it runs: its pieces in depth-first order packed into microbatches up to the budget, each
    call it runs (each piece handed a context or handing one on, and the whole trees together) paying the cost model's
    fixed cost; every replica padded to the same slot count."""
    units: dict[int, list[Piece]] = {}
    for piece in pieces:
        units.setdefault(piece.index if cross_replica else piece.tree, []).append(piece)
    order = sorted(units, key=lambda u: (-sum(p.cost for p in units[u]), u))
    loads = [0.0] * num_replicas
    assigned: list[list[int]] = [[] for _ in range(num_replicas)]
    for unit in order:
        replica = min(range(num_replicas), key=lambda r: (loads[r], r))
        assigned[replica].append(unit)
        loads[replica] += sum(p.cost for p in units[unit])
    overhead = cost_model.cost({"microbatches": 1})
    own_call = _runs_alone(pieces)

    def replica_slots(unit_list: list[int]) -> list[Microbatch]:
        slots: list[Microbatch] = []
        for piece in sorted((p for u in unit_list for p in units[u]), key=lambda p: p.index):  # sources first
            if not slots or slots[-1].unique_tokens + piece.unique_tokens > token_budget:
                slots.append(Microbatch())
            slots[-1].pieces.append(piece.index)
            slots[-1].unique_tokens += piece.unique_tokens
            slots[-1].cost += piece.cost
        for slot in slots:  # whole trees of a microbatch share one call (_merge_whole_trees); the others run alone
            alone = sum(own_call[i] for i in slot.pieces)
            slot.cost += overhead * (alone + (alone < len(slot.pieces)))
        return slots

    unit_cost = {u: sum(p.cost for p in units[u]) for u in units}

    def running_cost(unit_list: list[int]) -> float:
        return sum(slot.cost for slot in replica_slots(unit_list))

    # the search on the running cost is local: start it from LPT and from LPT rebalanced on the units' own costs,
    # keep the lower makespan (the first on a tie)
    starts = [[list(units_of) for units_of in assigned] for _ in range(2)]
    _rebalance(starts[1], lambda unit_list: sum(unit_cost[u] for u in unit_list), unit_cost)
    for start in starts:
        _rebalance(start, running_cost, unit_cost)
    assigned = min(starts, key=lambda start: max(map(running_cost, start)))
    replicas = [replica_slots(unit_list) for unit_list in assigned]
    num_slots = max(1, max(len(slots) for slots in replicas))
    for slots in replicas:
        slots.extend(Microbatch() for _ in range(num_slots - len(slots)))
    return replicas


def _rebalance(assigned: list[list[int]], replica_cost, unit_cost: dict[int, float], rounds: int = 200) -> None:
    """Local search after LPT: move a unit, or else swap two, between the most and the least loaded replica while
    that lowers the larger of the two loads; ``replica_cost(units)`` is a replica's load, ``unit_cost`` each unit's
    own (deterministic, in place)."""
    loads = [replica_cost(unit_list) for unit_list in assigned]
    for _ in range(rounds):
        high = max(range(len(loads)), key=lambda r: (loads[r], -r))
        low = min(range(len(loads)), key=lambda r: (loads[r], r))
        if loads[high] - loads[low] <= 0:
            return
        best = None  # (new larger load, new high load, new low load, unit out of high, unit out of low or None)
        for swaps in (False, True):  # swaps only where no move helps
            for unit in assigned[high]:
                for other in assigned[low] if swaps else [None]:
                    if other is not None and not 0 < unit_cost[unit] - unit_cost[other] < loads[high] - loads[low]:
                        continue  # a swap that does not narrow the gap in the units' own costs
                    kept = [u for u in assigned[high] if u != unit] + ([] if other is None else [other])
                    moved = [u for u in assigned[low] if u != other] + [unit]
                    new_high, new_low = replica_cost(kept), replica_cost(moved)
                    candidate = (max(new_high, new_low), new_high, new_low, unit, other)
                    if candidate[0] < loads[high] - 1e-12 and (best is None or candidate[0] < best[0]):
                        best = candidate
            if best is not None:
                break
        if best is None:
            return
        _, new_high, new_low, unit, other = best
        assigned[high].remove(unit)
        assigned[low].append(unit)
        if other is not None:
            assigned[low].remove(other)
            assigned[high].append(other)
        loads[high], loads[low] = new_high, new_low
