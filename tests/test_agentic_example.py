"""examples/agentic_tree_rollouts.py: multi-turn calculator rollouts that branch at turn boundaries, with thinking
dropped from later turns, fed to TRL through ``rollout_func``.

- the script runs a few steps as a subprocess, exits 0 and logs tree/R_tok > 1.5 (above the prompt-only sharing
  of plain GRPO groups);
- the rollout's rows: one per prompt entry, groups of ``num_generations``, history and tool results marked
  ``env_mask`` 0, no thinking in the history, each row exactly the chat-template rendering of its conversation,
  the tree shape of ``branching``, deterministic given the seed; the reward is verifiable;
- ``TreeGRPOTrainer`` and TRL's ``GRPOTrainer`` give the same loss and gradients on one batch of those rows (both
  trainers sample the same batch: same weights, rollout seeded identically).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from trl import GRPOConfig, GRPOTrainer

from harts_hf import TreeGRPOConfig, TreeGRPOTrainer
from harts_hf.model_patches import cpu_safe
from tests.models import build
from tests.test_tree_grpo import assert_same_loss_and_grads, prepared
from tests.trl_helpers import char_tokenizer, cpu_safe_trainer

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "agentic_tree_rollouts.py"


def _load_example():
    spec = importlib.util.spec_from_file_location("agentic_tree_rollouts", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


ex = _load_example()


# ---------------------------------------------------------------------------------------------- the script
def test_example_runs_and_shares_prefixes(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    result = subprocess.run([sys.executable, str(EXAMPLE), "--steps", "3", "--out", str(tmp_path)], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "mean tree/R_tok over the run" in result.stdout
    history = json.loads((tmp_path / "history.json").read_text())
    steps = history["steps"]
    assert [s["step"] for s in steps] == [1, 2, 3]
    for step in steps:
        assert step["tree/R_tok"] > 1.5, step
        assert step["tree/R_tok"] > step["prompt_only_R_tok"] + 0.5, step  # branching shares more than the prompt
        assert step["tree/unique_tokens"] < step["tree/path_tokens"]
        assert abs(step["tree/R_tok"] - step["rollout_R_tok"]) < 1e-6  # one tree forward = the whole batch
        assert 0.0 <= step["reward"] <= 1.0
    assert history["summary"]["mean_R_tok"] > 2.0


# ---------------------------------------------------------------------------------------------- the rollout's rows
@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


@pytest.fixture(scope="module")
def model():
    return cpu_safe(build("qwen3_next")).model  # generates on the CPU


def _conversation_text(tokenizer, prompt, history_text):
    """The chat-template rendering of prompt + earlier (thinking-free) actions and tool results, ready for the
    next assistant turn; also returns the list of (action, tool reply) pairs read from the history."""
    pairs = re.findall(r"((?:calc|answer)\([^()]*\))<\|im_end\|>\n<\|im_start\|>tool\n(=[^<]*)<\|im_end\|>", history_text)
    messages = list(prompt)
    for action, reply in pairs:
        messages += [{"role": "assistant", "content": action}, {"role": "tool", "content": reply}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), pairs


@pytest.mark.parametrize("branching", [(2, 3), (1, 2, 2)])
def test_rollout_rows_form_trees_with_environment_tokens(model, tokenizer, branching):
    rollout = ex.TreeRollout(branching, seed=0)
    group = rollout.group_size
    assert group == sum(torch.tensor(branching).cumprod(0).tolist())
    dataset = ex.puzzle_dataset(2)
    prompts = [dataset[i]["prompt"] for i in range(2) for _ in range(group)]
    out = rollout.rollout(prompts, model, tokenizer)
    n = len(prompts)
    assert {k: len(v) for k, v in out.items()} == {k: n for k in out}  # one row per entry of prompts
    turn_pattern = re.compile(r"\[[^\[\]()]*\](calc|answer)\([0-9+*-]*\)<\|im_end\|>")
    zeros = 0
    for g in range(2):
        rows = range(g * group, (g + 1) * group)
        prompt = prompts[g * group]
        assert all(out["prompt_ids"][r] == out["prompt_ids"][g * group] for r in rows)
        depth_count, histories = [0] * len(branching), {}
        for r in rows:
            ids, mask, logps = out["completion_ids"][r], out["env_mask"][r], out["logprobs"][r]
            assert len(ids) == len(mask) == len(logps) and ids[-1] == tokenizer.eos_token_id
            cut = mask.index(1)
            assert mask == [0] * cut + [1] * (len(ids) - cut)  # history (env) first, then this row's turn
            assert all(lp == 0.0 for lp in logps[:cut]) and all(lp <= 0.0 for lp in logps[cut:])
            zeros += cut
            history, turn = tokenizer.decode(ids[:cut]), tokenizer.decode(ids[cut:])
            assert turn_pattern.fullmatch(turn), turn
            assert "[" not in history  # thinking is dropped from later turns
            rendered, pairs = _conversation_text(tokenizer, prompt, history)
            assert tokenizer.decode(out["prompt_ids"][r] + ids) == rendered + turn  # exactly the chat rendering
            for action, reply in pairs:  # the environment's replies are the calculator's
                assert reply == ex.observe(action)
            depth = len(pairs)
            assert turn_pattern.fullmatch(turn).group(1) == ("answer" if depth == len(branching) - 1 else "calc")
            depth_count[depth] += 1
            histories.setdefault(tuple(ids[:cut]), []).append(r)
        assert depth_count == torch.tensor(branching).cumprod(0).tolist()  # the tree's width per depth
        # siblings share their whole history: one history per parent, each with branching[depth] children
        for history, children in histories.items():
            depth = len(_conversation_text(tokenizer, prompt, tokenizer.decode(list(history)))[1])
            assert len(children) == branching[depth]
    assert zeros > 0  # env_mask zeros exist: the history and tool results of later turns
    stats = rollout.stats[-1]
    r_tok = stats["path_tokens"] / stats["unique_tokens"]
    assert r_tok > 2.0 and r_tok > stats["path_tokens"] / stats["unique_tokens_prompt_only"] + 0.5

    # rewards: verifiable; an earlier turn scores the answers below it (mean of its subtree's final rows)
    completions = [[{"role": "assistant", "content": tokenizer.decode(c, skip_special_tokens=True)}]
                   for c in out["completion_ids"]]
    targets = [dataset[i]["target"] for i in range(2) for _ in range(group)]
    rewards = ex.tree_reward(completions, targets, out["subtree_answers"])
    for r, (completion, target, below) in enumerate(zip(completions, targets, out["subtree_answers"])):
        answers = ex.row_answers(completion[0]["content"], below)
        assert rewards[r] == pytest.approx(sum(ex.score_answer(a, target) for a in answers) / len(answers))

    # deterministic given the seed and the call number
    again = ex.TreeRollout(branching, seed=0).rollout(prompts, model, tokenizer)
    assert again["completion_ids"] == out["completion_ids"] and again["env_mask"] == out["env_mask"]
    assert rollout.rollout(prompts, model, tokenizer)["completion_ids"] != out["completion_ids"]


def test_environment_and_reward():
    assert ex.calculate("7*8+5") == 61 and ex.calculate("2-3*4") == -10 and ex.calculate("7*") is None
    assert ex.observe("calc(7*8+5)") == "=61" and ex.observe("calc()") == "=error"
    # a number or result over Python's 4300-digit int-to-str limit: an error reply, not an exception in rollout
    for huge in ("9" * 5000, "9" * 90 + "*" + "9" * 90, "99999*" * 900 + "1", "99999**99999"):
        assert ex.calculate(huge) is None and ex.observe(f"calc({huge})") == "=error"
    assert ex.score_answer("9" * 5000, 61) == 0.0 and ex.score_answer("²", 61) == 0.0
    assert ex.score_answer("61", 61) == 1.0 and ex.score_answer("", 61) == 0.0
    assert 0.0 < ex.score_answer("60", 61) < 0.5 and ex.score_answer("999", 61) == 0.0
    text = "calc(7*8+5)\ntool\n=61\nassistant\n[so]answer(61)"
    assert ex.tree_reward([text], [61], [["61"]]) == [1.0]
    assert ex.tree_reward(["[hm]calc(7*8)"], [61], [["61", "999"]]) == [0.5]  # an earlier turn: its subtree
    with pytest.raises(ValueError, match="multiple of 8"):
        ex.TreeRollout((2, 3)).rollout([[{"role": "user", "content": "1+1"}]] * 3, build("qwen3_next"), char_tokenizer())


# ---------------------------------------------------------------------------------------------- tree vs TRL
ARGS = dict(per_device_train_batch_size=16, num_generations=8, max_completion_length=96, learning_rate=1e-2,
            optim="sgd", bf16=False, use_cpu=True, report_to="none", logging_steps=1, save_strategy="no", seed=0,
            disable_dropout=True, temperature=0.9, gradient_checkpointing=False, beta=0.0)


@pytest.mark.parametrize("options", [
    dict(),
    dict(num_iterations=2, loss_type="grpo"),
    dict(tree_keep_groups_together=False, tree_share_across_groups=False),
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "defaults")
def test_tree_and_grpo_trainers_match_on_agentic_batch(tmp_path, tokenizer, monkeypatch, options):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    tree_only = {k: v for k, v in options.items() if k.startswith("tree_")}
    args = dict(ARGS, output_dir=str(tmp_path), **{k: v for k, v in options.items() if k not in tree_only})
    trainers = []
    for trainer_class, config in ((GRPOTrainer, GRPOConfig(**args)), (TreeGRPOTrainer, TreeGRPOConfig(**args, **tree_only))):
        model = build("qwen3_next")  # the same seeded weights in both
        model.config.router_aux_loss_coef = 0.0
        trainers.append(trainer_class(model, reward_funcs=ex.tree_reward, args=config, train_dataset=ex.puzzle_dataset(8),
                                      processing_class=tokenizer, rollout_func=ex.TreeRollout((2, 3), seed=0)))
    base, tree = map(cpu_safe_trainer, trainers)
    # the batch TRL builds from the rollout: environment tokens masked out through tool_mask, in both trainers
    batches = [prepared(base), prepared(tree)]
    for inputs in batches:
        tool_mask = inputs["tool_mask"][inputs["completion_mask"].bool()]
        assert (tool_mask == 0).any() and (tool_mask == 1).any()
    assert sorted(map(tuple, batches[0]["completion_ids"].tolist())) == sorted(map(tuple, batches[1]["completion_ids"].tolist()))
    tree._tree_metrics.clear()
    loss, worst = assert_same_loss_and_grads(base, tree)  # samples the next batch in both (same seeds) and compares
    assert torch.isfinite(torch.tensor(loss))
    path, unique = sum(tree._tree_metrics["path_tokens"]), sum(tree._tree_metrics["unique_tokens"])
    assert path / unique > 1.5, (path, unique)
