"""Placement of whole prompt groups on data-parallel replicas (harts_hf.planner.assign_groups) and the batch
plumbing around it (harts_hf.trainers.replica_balance), without processes: gathering is a concatenation."""

import random
from types import SimpleNamespace

import pytest
import torch

from harts_hf.planner import CostModel, assign_groups, group_cost, imbalance
from harts_hf.trainers.replica_balance import (
    balance_blocker,
    batch_layout,
    place_groups,
    prompt_groups,
    select_rows,
    widen,
)

PAD = 0


def loads_of(replica_of, costs, num_replicas):
    loads = [0.0] * num_replicas
    for group, replica in enumerate(replica_of):
        loads[replica] += costs[group]
    return loads


def rows_of(replica_of, sizes, num_replicas):
    rows = [0] * num_replicas
    for group, replica in enumerate(replica_of):
        rows[replica] += sizes[group]
    return rows


@pytest.mark.parametrize("num_replicas", [2, 3, 4])
def test_equal_rows_deterministic_and_better_than_the_contiguous_split(num_replicas):
    rng = random.Random(num_replicas)
    for _ in range(20):
        groups_per_replica = rng.randint(1, 5)
        sizes = [4] * (num_replicas * groups_per_replica)
        costs = [rng.choice([1.0, 1.0, 2.0, 20.0]) * rng.uniform(0.5, 1.5) for _ in sizes]
        contiguous = [g // groups_per_replica for g in range(len(sizes))]  # TRL: consecutive prompts per process
        replica_of = assign_groups(sizes, costs, num_replicas, initial=contiguous)
        assert replica_of == assign_groups(sizes, costs, num_replicas, initial=contiguous)
        assert rows_of(replica_of, sizes, num_replicas) == [4 * groups_per_replica] * num_replicas
        assert max(loads_of(replica_of, costs, num_replicas)) <= max(loads_of(contiguous, costs, num_replicas))
        without_initial = assign_groups(sizes, costs, num_replicas)
        assert rows_of(without_initial, sizes, num_replicas) == [4 * groups_per_replica] * num_replicas


def test_uneven_groups_get_balanced():
    """Two big trees first (TRL gives both to process 0), two small ones after: one of each per process."""
    sizes, costs = [6, 6, 6, 6], [10.0, 9.0, 1.0, 1.0]
    replica_of = assign_groups(sizes, costs, 2, initial=[0, 0, 1, 1])
    assert sorted(loads_of(replica_of, costs, 2)) == [10.0, 11.0]
    assert imbalance(loads_of([0, 0, 1, 1], costs, 2)) == pytest.approx(19 / 10.5)
    assert imbalance(loads_of(replica_of, costs, 2)) == pytest.approx(11 / 10.5)


def test_mixed_sizes_keep_row_counts():
    """A merged group (duplicate prompts: 12 rows) and 6-row groups: swaps only trade groups of one size."""
    sizes, costs = [12, 6, 6, 6, 6], [5.0, 4.0, 3.0, 2.0, 1.0]
    replica_of = assign_groups(sizes, costs, 2)
    assert rows_of(replica_of, sizes, 2) == [18, 18]
    assert max(loads_of(replica_of, costs, 2)) == 8.0


def test_no_equal_split_returns_none_or_the_initial_one():
    assert assign_groups([6, 6, 6], [1.0, 2.0, 3.0], 2) is None  # 9 rows per replica: no whole groups fit
    # a placement exists ({3, 3} and {2, 2, 2}) but the greedy orders miss it: the given one is kept
    sizes, costs = [3, 3, 2, 2, 2], [1.0, 1.0, 5.0, 5.0, 1.0]
    assert assign_groups(sizes, costs, 2) is None
    assert assign_groups(sizes, costs, 2, initial=[0, 0, 1, 1, 1]) == [0, 0, 1, 1, 1]


@pytest.mark.parametrize("arguments, match", [
    (([6, 6], [1.0], 2), "one cost per group"),
    (([6, 0], [1.0, 1.0], 2), "positive integers"),
    (([6, 6], [1.0, float("nan")], 2), "finite"),
    (([6, 6], [1.0, -1.0], 2), "finite"),
    (([6, 6], [1.0, 1.0], 0), "num_replicas"),
    (([6, 5], [1.0, 1.0], 2), "split evenly"),
])
def test_bad_input_fails_early(arguments, match):
    with pytest.raises(ValueError, match=match):
        assign_groups(*arguments)
    with pytest.raises(ValueError, match="does not give every replica"):
        assign_groups([6, 6], [1.0, 1.0], 2, initial=[0, 0])


def test_group_cost_grows_with_the_tree():
    prompt = list(range(1, 20))
    small = [prompt + [30, 31], prompt + [30, 32]]
    big = [prompt + list(range(40, 140)), prompt + list(range(40, 90)) + [7] * 30]
    assert group_cost(big) > group_cost(small) > 0
    # identical sequences: the same tokens, more leaves, which cost what the cost model says (the H200 fit: nothing)
    assert group_cost(small * 2) == group_cost(small)
    with_leaves = CostModel(leaves=1e-3)
    assert group_cost(small * 2, with_leaves) == pytest.approx(group_cost(small, with_leaves) + 2e-3)


# ---------------------------------------------------------------- batch plumbing
def rank_batch(prompts, completions, advantages, num_items=99):
    """A TRL-shaped generation batch: prompts left-padded, completions right-padded, old log-probs beside them."""
    prompt_width, completion_width = max(map(len, prompts)), max(map(len, completions))
    prompt_ids = torch.tensor([[PAD] * (prompt_width - len(p)) + p for p in prompts])
    prompt_mask = torch.tensor([[0] * (prompt_width - len(p)) + [1] * len(p) for p in prompts])
    completion_ids = torch.tensor([c + [PAD] * (completion_width - len(c)) for c in completions])
    completion_mask = torch.tensor([[1] * len(c) + [0] * (completion_width - len(c)) for c in completions])
    old = torch.randn(completion_ids.shape) * completion_mask
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
            "completion_mask": completion_mask, "advantages": torch.tensor(advantages),
            "num_items_in_batch": torch.tensor(num_items), "old_per_token_logps": old}


def gathered(batches, layout):
    prompt_width = max(b["prompt_ids"].shape[1] for b in batches)
    completion_width = max(b["completion_ids"].shape[1] for b in batches)
    wide = [widen(b, layout, prompt_width, completion_width, PAD) for b in batches]
    return {key: wide[0][key] if layout[key] == "global" else torch.cat([w[key] for w in wide]) for key in wide[0]}


def two_ranks():
    torch.manual_seed(0)
    big = [5, 6, 7] * 20
    rank0 = rank_batch([[1, 2, 3]] * 2 + [[4, 2]] * 2, [big, big + [8], [9], [9, 8]], [0.5, -0.5, 1.0, -1.0])
    rank1 = rank_batch([[7, 7, 7, 7, 7]] * 2 + [[8]] * 2, [[1, 2], [1], [3], [3, 4, 5]], [0.1, -0.1, 0.2, -0.2])
    return rank0, rank1


def test_widen_then_select_gives_back_each_rank_as_trl_padded_it():
    rank0, rank1 = two_ranks()
    layout = batch_layout(rank0, sequence_level_ratio=False)
    everything = gathered([rank0, rank1], layout)
    assert everything["prompt_ids"].shape == (8, 5) and everything["completion_ids"].shape == (8, 61)
    for rank, batch in enumerate((rank0, rank1)):
        back = select_rows(everything, layout, list(range(4 * rank, 4 * rank + 4)))
        assert back.keys() == batch.keys()
        for key in batch:
            assert torch.equal(back[key], batch[key]), key


def test_select_trims_to_the_rows_kept_and_rounds_like_trl():
    rank0, rank1 = two_ranks()
    layout = batch_layout(rank0, sequence_level_ratio=False)
    everything = gathered([rank0, rank1], layout)
    mixed = select_rows(everything, layout, [2, 3, 4, 5])  # the small group of rank 0, the long prompt of rank 1
    assert mixed["prompt_ids"].shape == (4, 5) and mixed["completion_ids"].shape == (4, 2)
    assert mixed["prompt_ids"][0].tolist() == [PAD, PAD, PAD, 4, 2] and mixed["prompt_mask"][0].sum() == 2
    assert mixed["completion_ids"].tolist() == [[9, PAD], [9, 8], [1, 2], [1, PAD]]
    assert mixed["advantages"].tolist() == pytest.approx([1.0, -1.0, 0.1, -0.1])
    assert torch.equal(mixed["num_items_in_batch"], rank0["num_items_in_batch"])
    rounded = select_rows(everything, layout, [6, 7], pad_to_multiple_of=4)
    assert rounded["prompt_ids"].shape == (2, 4) and rounded["completion_ids"].shape == (2, 4)


def test_place_groups_balances_a_gathered_batch():
    """TRL gives both big trees to process 0: afterwards each process holds one big and one small group."""
    big = list(range(10, 70))
    rank0 = rank_batch([[1, 2, 3]] * 2 + [[4, 2]] * 2, [big, big[:40] + [9] * 20, big[::-1], big[:30]], [0.0] * 4)
    rank1 = rank_batch([[7, 7, 7, 7, 7]] * 2 + [[8]] * 2, [[1, 2], [1], [3], [3, 4, 5]], [0.0] * 4)
    layout = batch_layout(rank0, sequence_level_ratio=False)
    everything = gathered([rank0, rank1], layout)
    assert prompt_groups(everything) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    placement = place_groups(everything, 2)
    assert [len(rows) for rows in placement["rows"]] == [4, 4] and placement["moved_rows"] == 4
    assert all(len({0, 1, 2, 3} & set(rows)) == 2 for rows in placement["rows"])  # one big group (rows 0-3) each
    assert imbalance(placement["loads_before"]) > 1.3 and imbalance(placement["loads_after"]) < 1.1
    layout = batch_layout(rank0, sequence_level_ratio=False)
    everything = gathered(two_ranks(), layout)
    prompts = [0, 0, 0, 2, 2, 2, 4, 4]  # groups of 3, 3 and 2 rows (two straddle TRL's split): no 4 + 4 of whole ones
    straddling = dict(everything, prompt_ids=everything["prompt_ids"][prompts],
                      prompt_mask=everything["prompt_mask"][prompts])
    placement = place_groups(straddling, 2)
    assert placement["rows"] is None and placement["loads_after"] == placement["loads_before"]


def test_layout_refuses_what_it_cannot_move():
    rank0, _ = two_ranks()
    with pytest.raises(ValueError, match="'my_field'.*tree_balance_replicas=False"):
        batch_layout(dict(rank0, my_field=torch.zeros(4)), sequence_level_ratio=False)
    with pytest.raises(ValueError, match="'advantages' is a list"):
        batch_layout(dict(rank0, advantages=[0.0] * 4), sequence_level_ratio=False)
    ratio = torch.ones(4, 1)
    assert batch_layout(dict(rank0, importance_sampling_ratio=ratio), sequence_level_ratio=True)[
        "importance_sampling_ratio"] == "row"
    assert batch_layout(dict(rank0, advantages=torch.zeros(4, 61)), sequence_level_ratio=False)["advantages"] == "right"


@pytest.mark.parametrize("loss_type", ["grpo", "sapo", "luspo", "dr_grpo", "dapo", "cispo", "vespo", "bnpo"])
def test_loss_types_that_keep_their_meaning_when_rows_move(loss_type):
    trainer = SimpleNamespace(loss_type=loss_type, _entropy_bonus_enabled=False, aux_loss_enabled=False,
                              top_entropy_quantile=1.0)
    assert (balance_blocker(trainer) is None) == (loss_type != "bnpo")
    for change, word in (dict(_entropy_bonus_enabled=True), "entropy bonus"), \
                        (dict(aux_loss_enabled=True), "load-balancing"), (dict(top_entropy_quantile=0.8), "quantile"):
        reason = balance_blocker(SimpleNamespace(**{**vars(trainer), "loss_type": "grpo", **change}))
        assert reason is not None and word in reason
