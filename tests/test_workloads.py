"""Tests of harts_hf.workloads: determinism, loss masks, exact shapes, preset statistics, bad inputs."""

import math

import numpy as np
import pytest

from harts_hf.workloads import PRESETS, Workload, agentic_rollouts, fixed_branching, grpo_groups, make_workload

# exact lengths (length_sigma = 0) make path and unique token counts computable by hand
EXACT = dict(system_prompt_len=10, issue_len=5, think_len=4, action_len=3, observation_len=2, length_sigma=0)


def common_prefix(a, b):
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if differ.size else n


def check_well_formed(workload: Workload, vocab_size: int = 151936):
    assert len(workload.sequences) == len(workload.loss_masks) > 0
    for sequence, mask in zip(workload.sequences, workload.loss_masks):
        assert len(sequence) == len(mask) >= 1
        assert all(isinstance(token, int) for token in sequence[:50])
        assert all(isinstance(flag, bool) for flag in mask[:50])
        assert 0 <= min(sequence) and max(sequence) < vocab_size


# ---------------------------------------------------------------------- determinism
@pytest.mark.parametrize("make", [
    lambda seed: make_workload("swe", scale=0.01, seed=seed),
    lambda seed: make_workload("search", scale=0.02, seed=seed),
    lambda seed: grpo_groups(4, 4, 20, 30, system_prompt_len=8, seed=seed),
    lambda seed: fixed_branching((2, 3), 5, root_len=4, seed=seed),
])
def test_same_seed_same_workload_other_seed_differs(make):
    first, again, other = make(0), make(0), make(1)
    assert first.sequences == again.sequences and first.loss_masks == again.loss_masks
    assert first.params == again.params
    assert first.sequences != other.sequences
    check_well_formed(first)


# ---------------------------------------------------------------------- agentic structure
def test_divergence_drops_thinking_from_later_turns():
    w = agentic_rollouts(1, 1, 4, divergence_prob=1.0, **EXACT)
    assert [len(s) for s in w.sequences] == [22, 27, 32, 37]  # 15 + 5 t + think + action; final 15 + 3*5 + 7
    # sequence t+1 shares with sequence t exactly the prefix up to turn t's thinking
    assert [common_prefix(a, b) for a, b in zip(w.sequences, w.sequences[1:])] == [15, 20, 25]
    assert w.loss_masks[-1] == [False] * 15 + ([True] * 3 + [False] * 2) * 3 + [True] * 7
    assert w.loss_masks[0] == [False] * 15 + [True] * 7
    stats = w.forest().stats()
    assert stats["path_tokens"] == 118 and stats["unique_tokens"] == 15 + 3 * 7 + 3 * 5 + 7


def test_no_divergence_gives_one_trajectory_per_rollout():
    w = agentic_rollouts(2, 3, 4, divergence_prob=0.0, **EXACT)
    assert len(w.sequences) == 6 and all(len(s) == 15 + 3 * 9 + 7 for s in w.sequences)
    stats = w.forest().stats()
    assert stats["unique_tokens"] == 10 + 2 * 5 + 6 * (3 * 9 + 7)  # system once, issue per task


def test_stratified_divergence_count_is_fixed():
    w = agentic_rollouts(1, 5, 21, divergence_prob=0.25, divergence_sampling="stratified", **EXACT)
    assert len(w.sequences) == 5 * (5 + 1)  # 20 eligible turns * 0.25, plus the final trajectory


def test_subagents_share_only_the_system_prompt():
    w = agentic_rollouts(1, 1, 3, divergence_prob=0.0, subagent_prob=1.0, subagent_turns=2, subagent_task_len=6,
                         **EXACT)
    *subagents, final = w.sequences
    assert len(subagents) == 2 and all(len(s) == 10 + 6 + 2 * 7 + 2 for s in subagents)
    assert all(common_prefix(s, final) == 10 for s in subagents)
    assert not any(w.loss_masks[0][:16])


def test_compaction_restarts_from_system_prompt_and_summary():
    w = agentic_rollouts(1, 1, 20, divergence_prob=0.0, compaction_threshold=40, summary_len=8, **EXACT)
    assert len(w.sequences) > 2
    system = w.sequences[0][:10]
    for before, after in zip(w.sequences, w.sequences[1:]):
        assert after[:10] == system and common_prefix(before, after) == 10
        assert after[10:18] == before[-8:]  # the summary ends one context and starts the next
        assert w.loss_masks[w.sequences.index(before)][-8:] == [True] * 8
        assert not any(w.loss_masks[w.sequences.index(after)][:18])
    assert max(len(s) for s in w.sequences) <= 40 + 9 + 8


def test_token_forks_branch_inside_turns():
    w = agentic_rollouts(1, 1, 6, divergence_prob=0.0, fork_token_prob=1.0, max_branches=5,
                         **{**EXACT, "think_len": 40, "action_len": 30})
    assert len(w.sequences) == 5
    stats = w.forest().stats()
    assert stats["branch_points"] == 4 and stats["sequences"] == 5
    assert all(common_prefix(a, b) >= 15 for a in w.sequences for b in w.sequences)


def test_turn_forks_are_capped_by_max_branches():
    w = agentic_rollouts(1, 2, 8, divergence_prob=0.0, fork_prob=1.0, max_branches=3, **EXACT)
    assert len(w.sequences) == 2 * 3
    assert len({tuple(s) for s in w.sequences}) == 6


# ---------------------------------------------------------------------- grpo and fixed trees
def test_grpo_groups_exact_counts():
    w = grpo_groups(3, 4, 20, 30, system_prompt_len=7, prompt_len_sigma=0, completion_len_sigma=0)
    assert len(w.sequences) == 12 and all(len(s) == 57 for s in w.sequences)
    assert all(m == [False] * 27 + [True] * 30 for m in w.loss_masks)
    assert w.forest().stats()["unique_tokens"] == 7 + 3 * 20 + 12 * 30


def test_grpo_heavy_tailed_lengths_are_at_least_one():
    w = grpo_groups(2, 50, 1, 2, completion_len_sigma=2.0, seed=3)
    assert min(len(s) for s in w.sequences) >= 2


@pytest.mark.parametrize("branching,segment_len,root_len", [((6, 6, 6), 64, 128), ((2, 3, 4), (5, 1, 2), 0)])
def test_fixed_branching_shape(branching, segment_len, root_len):
    w = fixed_branching(branching, segment_len, root_len=root_len)
    lengths = segment_len if isinstance(segment_len, tuple) else (segment_len,) * len(branching)
    assert len(w.sequences) == math.prod(branching)
    assert all(len(s) == root_len + sum(lengths) for s in w.sequences)
    stats = w.forest().stats()
    expected = root_len + sum(n * math.prod(branching[:level + 1]) for level, n in enumerate(lengths))
    assert stats["unique_tokens"] == expected
    assert not any(w.loss_masks[0][:root_len]) and all(w.loss_masks[0][root_len:])


def test_small_vocabulary_keeps_ids_in_range_and_prefixes_apart():
    w = fixed_branching((4, 4), 3, root_len=2, vocab_size=50, seed=5)
    check_well_formed(w, vocab_size=50)
    assert w.forest().stats()["unique_tokens"] == 2 + 3 * (4 + 16)


# ---------------------------------------------------------------------- presets
@pytest.mark.parametrize("name,scale,seed", [
    ("swe", 0.02, 0), ("swe", 0.02, 1), ("swe", 0.05, 2), ("tau", 0.02, 0), ("tau", 0.05, 1),
    ("grpo", 0.02, 0), ("grpo", 0.1, 1), ("search", 0.02, 0), ("coding_agent", 0.02, 0), ("distinct", 0.02, 0),
])
def test_preset_r_tok_in_documented_range(name, scale, seed):
    w = make_workload(name, scale=scale, seed=seed)
    check_well_formed(w)
    low, high = PRESETS[name].r_tok_range
    assert low <= w.forest().stats()["R_tok"] <= high
    assert w.name == name and w.params["preset"] == name and w.params["scale"] == scale


def test_swe_system_prompt_is_shared_and_carries_no_loss():
    w = make_workload("swe", scale=0.02, seed=0)
    system_len = round(19000 * 0.02)
    system = w.sequences[0][:system_len]
    assert all(s[:system_len] == system for s in w.sequences)
    assert not any(any(m[:system_len + 1]) for m in w.loss_masks)  # system prompt and the issue's first token
    assert all(any(m) for m in w.loss_masks)  # every sequence trains on something


def test_scale_keeps_counts_and_shrinks_lengths():
    small, large = make_workload("grpo", scale=0.01), make_workload("grpo", scale=0.1)
    assert len(small.sequences) == len(large.sequences) == 64
    assert 5 < large.path_tokens / small.path_tokens < 15


def test_preset_overrides():
    w = make_workload("tau", scale=0.02, num_tasks=2)
    assert w.params["num_tasks"] == 2 and len(w.sequences) > len(make_workload("tau", scale=0.02).sequences)


def test_presets_document_their_source():
    for name, preset in PRESETS.items():
        assert "arXiv" in preset.doc or "docs." in preset.doc, name
        assert preset.r_tok_range[0] < preset.r_tok_range[1]


# ---------------------------------------------------------------------- bad input
@pytest.mark.parametrize("call,message", [
    (lambda: make_workload("nope"), r"known presets: coding_agent, distinct, grpo, search, swe, tau"),
    (lambda: make_workload("swe", scale=0), r"scale = 0; expected a finite number > 0"),
    (lambda: make_workload("swe", scale=-1.0), r"scale"),
    (lambda: make_workload("swe", turn=3), r"turn: not parameters of preset 'swe'"),
    (lambda: make_workload("swe", scale=0.01, think_len=-5), r"think_len = -5"),
    (lambda: agentic_rollouts(think_len=-5), r"think_len = -5; expected a token length >= 1"),
    (lambda: agentic_rollouts(system_prompt_len=-1), r"system_prompt_len = -1"),
    (lambda: agentic_rollouts(divergence_prob=1.5), r"divergence_prob = 1.5; expected a probability in \[0, 1\]"),
    (lambda: agentic_rollouts(fork_token_prob=-0.1), r"fork_token_prob"),
    (lambda: agentic_rollouts(divergence_sampling="random"), r"divergence_sampling"),
    (lambda: agentic_rollouts(turns=0), r"turns = 0; expected an integer >= 1"),
    (lambda: agentic_rollouts(compaction_threshold=0), r"compaction_threshold"),
    (lambda: grpo_groups(0, 8, 10, 10), r"num_prompts = 0"),
    (lambda: grpo_groups(2, 8, 10, -3), r"completion_len = -3"),
    (lambda: grpo_groups(2, 8, 10, 10, vocab_size=1), r"vocab_size = 1"),
    (lambda: fixed_branching(()), r"branching = \(\); expected a non-empty sequence"),
    (lambda: fixed_branching((2, 0)), r"branching\[1\] = 0"),
    (lambda: fixed_branching((2, 2), (3,)), r"segment_len has 1 entries"),
    (lambda: fixed_branching((2,), root_len=-1), r"root_len = -1"),
])
def test_bad_input_raises_value_error_naming_the_argument(call, message):
    with pytest.raises(ValueError, match=message):
        call()
