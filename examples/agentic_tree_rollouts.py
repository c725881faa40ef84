"""Agentic RL on prefix trees: multi-turn calculator-tool rollouts that branch at turn boundaries, trained with
``harts_hf.TreeGRPOTrainer`` through TRL's ``rollout_func``.

    python examples/agentic_tree_rollouts.py                    # tiny model, CPU, 20 steps (about half a minute)
    python examples/agentic_tree_rollouts.py --no-tree          # the same run through TRL's own log-prob code
    python examples/agentic_tree_rollouts.py --branching 2,2,2  # three turns: calc, calc, answer

The task: arithmetic puzzles such as ``7*8+5``. The model talks to a calculator environment: each assistant turn
is ``[thinking]`` followed by one action, ``calc(7*8+5)`` (the environment answers ``=61`` in a ``tool`` message)
or, at the last turn, ``answer(61)``, which is checked against the puzzle's value (the verifiable reward).

How the rollout works (``TreeRollout``), per prompt:

- turn by turn, the current policy samples each assistant turn (a small KV-cached sampling loop over
  ``trainer.model``; a tiny grammar keeps the turn well formed, see ``TurnGrammar``);
- the trajectory forks at turn boundaries: ``--branching 2,3`` samples 2 first turns from the prompt, and after
  each of them (and its tool result) 3 second turns, sampled independently;
- thinking is dropped from later turns, as reasoning models are served: a turn sees the earlier turns' *actions*
  and tool results, not their thinking. So every turn is its own training row, ``prompt + history + this turn``,
  with the loss on this turn only: the history (earlier actions, tool results) is marked ``env_mask = 0``
  (TRL's tool mask), the turn itself ``env_mask = 1``. Rows of one prompt share the prompt, and the rows after
  one earlier turn share that turn's action and tool result: the rows form a tree, and ``TreeGRPOTrainer``
  computes every shared token once;
- one group of ``num_generations`` rows comes back per prompt (``--branching 2,3``: 2 + 2*3 = 8 rows).

Rewards (``tree_reward``): a final row scores its own ``answer(n)`` (1 for the exact value, else a small credit for
being close); an earlier turn's row scores the answers reached below it in its tree (their mean), which the rollout
passes along per row as ``subtree_answers``. GRPO then normalises rewards inside each group.

Each step prints the mean reward, the share of exact answers and ``tree/R_tok`` (path tokens / unique tokens of
the step's tree forwards), next to the R_tok the same rows would give as plain GRPO groups, whose rows only share
the prompt (``R_tok prompt-only``). ``<out>/history.json`` keeps the per-step values.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import random
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SYSTEM_PROMPT = "calc(expr) replies =value. finish with answer(n)."
THINK_MAX = 12  # most thinking characters in one turn
EXPR_MAX = 8  # most characters inside calc(...)
NUMBER_MAX = 2  # most digits of one number inside calc(...)
ANSWER_MAX = 3  # most digits inside answer(...)
THINK_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 +-*="
OPERATORS = "+-*"
ACTION = re.compile(r"(calc|answer)\(([^()]*)\)")
MAX_DIGITS = 100  # the calculator refuses numbers and results of more digits (str() of a huge int raises)


# ---------------------------------------------------------------------------------------------- environment
def make_puzzles(n: int, seed: int = 0) -> list[tuple[str, int]]:
    """``n`` puzzles ``a*b+c`` with their values."""
    rng = random.Random(seed)
    puzzles = []
    for _ in range(n):
        a, b, c = rng.randint(2, 9), rng.randint(2, 9), rng.randint(1, 19)
        puzzles.append((f"{a}*{b}+{c}", a * b + c))
    return puzzles


def puzzle_dataset(n: int = 64, seed: int = 0):
    """Conversational prompts (system + user) and each puzzle's value in the column ``target``."""
    from datasets import Dataset

    puzzles = make_puzzles(n, seed)
    return Dataset.from_dict({
        "prompt": [[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": text}]
                   for text, _ in puzzles],
        "target": [value for _, value in puzzles],
    })


def calculate(expression: str) -> int | None:
    """The calculator tool: integers with ``+ - *`` (usual precedence); None for anything else, and for a number
    or an intermediate result of more than ``MAX_DIGITS`` digits (each checked before it is used)."""
    if not re.fullmatch(rf"[0-9]{{1,{MAX_DIGITS}}}([+*-][0-9]{{1,{MAX_DIGITS}}})*", expression):
        return None
    limit = 10**MAX_DIGITS
    parts = re.split(r"([+-])", expression)
    total, sign = 0, 1
    for part in parts:
        if part in ("+", "-"):
            sign = 1 if part == "+" else -1
            continue
        product = 1
        for factor in part.split("*"):
            product *= int(factor)
            if product >= limit:
                return None
        total += sign * product
        if abs(total) >= limit:
            return None
    return total


def observe(action: str) -> str:
    """The environment's reply to a ``calc(...)`` action: ``=value`` (or ``=error``)."""
    match = ACTION.fullmatch(action)
    value = calculate(match.group(2)) if match and match.group(1) == "calc" else None
    return "=error" if value is None else f"={value}"


def score_answer(answer: str, target: int) -> float:
    """1 for the exact value; otherwise up to 0.5 for being close (relative error), 0 if not a number."""
    if not re.fullmatch(rf"[0-9]{{1,{MAX_DIGITS}}}", answer):  # isdigit() lets "²" through to int()
        return 0.0
    value = int(answer)
    if value == target:
        return 1.0
    return 0.5 * max(0.0, 1.0 - abs(value - target) / max(target, 1))


def row_answers(completion: str, subtree_answers: list[str]) -> list[str]:
    """The answers a row is scored on: its own ``answer(n)`` if its turn is the final one, else those below it."""
    actions = ACTION.findall(completion)
    if actions and actions[-1][0] == "answer":
        return [actions[-1][1]]
    return list(subtree_answers)


def tree_reward(completions, target, subtree_answers, log_metric=None, **kwargs) -> list[float]:
    """Verifiable reward per row: the mean score of the answers the row led to (its own, for a final turn)."""
    rewards, exact, final = [], 0, 0
    for completion, value, below in zip(completions, target, subtree_answers):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        answers = row_answers(text, below)
        scores = [score_answer(a, value) for a in answers]
        rewards.append(sum(scores) / max(len(scores), 1))
        actions = ACTION.findall(text)
        if actions and actions[-1][0] == "answer":
            final += 1
            exact += scores[0] == 1.0
    if log_metric is not None and final:
        log_metric("exact", exact / final)  # share of final answers that are exactly right
    return rewards


# ---------------------------------------------------------------------------------------------- turn sampling
class TurnGrammar:
    """Which tokens may come next in an assistant turn ``[thinking]calc(expr)<eos>`` or ``[thinking]answer(n)<eos>``.

    A tiny random model would almost never write a parsable action, so sampling is constrained: the policy's
    distribution, renormalised over the allowed tokens (the thinking itself is free text up to ``THINK_MAX``
    characters). The trainer scores the sampled tokens under the unconstrained policy, as it would score any
    sampled text."""

    def __init__(self, tokenizer):
        vocab = tokenizer.get_vocab()
        self.eos = tokenizer.eos_token_id
        self.char_id = {ch: vocab[ch] for ch in set(THINK_CHARS + "[]()" + "calcanswer" + OPERATORS) if ch in vocab}
        missing = set(THINK_CHARS + "[]()") - set(self.char_id)
        if missing:
            raise ValueError(f"the tokenizer has no single-character tokens for {sorted(missing)}")
        self.id_char = {i: ch for ch, i in self.char_id.items()}

    def _ids(self, chars) -> list[int]:
        return [self.char_id[ch] for ch in chars]

    def allowed(self, text: str, final: bool) -> list[int]:
        """Allowed next token ids after the turn text ``text`` (an empty list once the turn has ended)."""
        if text == "":
            return self._ids("[")
        if "]" not in text:  # thinking
            return self._ids("]") if len(text) - 1 >= THINK_MAX else self._ids(THINK_CHARS + "]")
        action = text[text.index("]") + 1:]
        keyword = "answer(" if final else "calc("
        if len(action) < len(keyword):
            return self._ids(keyword[len(action)])
        argument = action[len(keyword):]
        if argument.endswith(")"):
            return [self.eos]
        if final:
            digits = self._ids("0123456789") if len(argument) < ANSWER_MAX else []
            return digits + (self._ids(")") if argument else [])
        if argument == "" or argument[-1] in OPERATORS:
            return self._ids("0123456789")
        number = re.split(r"[+*-]", argument)[-1]
        options = []
        if len(number) < NUMBER_MAX and len(argument) < EXPR_MAX:
            options += self._ids("0123456789")
        if len(argument) <= EXPR_MAX - 2:
            options += self._ids(OPERATORS)
        return options + self._ids(")")

    @staticmethod
    def max_turn_tokens(final: bool) -> int:
        return 2 + THINK_MAX + (len("answer()") + ANSWER_MAX if final else len("calc()") + EXPR_MAX) + 1


def _cache_keyword(model) -> str:
    """``cache`` on newer transformers, ``past_key_values`` on 5.17."""
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


@torch.no_grad()
def sample_turns(model, context: list[int], count: int, final: bool, grammar: TurnGrammar,
                 generator: torch.Generator, temperature: float) -> list[tuple[list[int], list[float], str]]:
    """``count`` independent turns after the same ``context`` (one batch, so no padding is needed), each as
    (token ids ending in EOS, sampling log-probs, text without EOS)."""
    device = next(model.parameters()).device
    inputs = torch.tensor([context] * count, device=device)
    output = model(input_ids=inputs, use_cache=True, logits_to_keep=1)
    texts, ids, logps = [""] * count, [[] for _ in range(count)], [[] for _ in range(count)]
    done = [False] * count
    limit = grammar.max_turn_tokens(final)
    for _ in range(limit):
        logits = output.logits[:, -1].float() / temperature
        mask = torch.full_like(logits, float("-inf"))
        for row in range(count):
            allowed = [grammar.eos] if done[row] else grammar.allowed(texts[row], final)
            mask[row, allowed] = 0.0
        log_probs = torch.log_softmax(logits + mask, dim=-1)
        tokens = torch.multinomial(log_probs.exp().cpu(), 1, generator=generator).squeeze(1)
        for row in range(count):
            if done[row]:
                continue
            token = int(tokens[row])
            ids[row].append(token)
            logps[row].append(float(log_probs[row, token]))
            if token == grammar.eos:
                done[row] = True
            else:
                texts[row] += grammar.id_char[token]
        if all(done):
            break
        cache = output.get("cache", None) or output.get("past_key_values", None)  # renamed in transformers 5.2x
        output = model(input_ids=tokens.view(-1, 1).to(device), use_cache=True, logits_to_keep=1,
                       **{_cache_keyword(model): cache})
    if not all(done):
        raise RuntimeError("a turn did not end within the grammar's length bound")
    return list(zip(ids, logps, texts))


# ---------------------------------------------------------------------------------------------- tree rollout
@dataclass
class Turn:
    """One node of a rollout tree: an assistant turn, sampled after ``history`` (thinking already dropped)."""

    history: list[int]  # tokens between the prompt and this turn: earlier actions and tool results
    ids: list[int]  # this turn: thinking + action + EOS
    logprobs: list[float]
    text: str
    final: bool
    children: list[Turn] = field(default_factory=list)

    @property
    def action(self) -> str:
        return self.text[self.text.index("]") + 1:]

    def answers(self) -> list[str]:
        """The final answers in this node's subtree (itself, for a final turn)."""
        if self.final:
            return [ACTION.fullmatch(self.action).group(2)]
        return [a for child in self.children for a in child.answers()]


def shared_token_count(sequences) -> int:
    """Unique tokens of a set of sequences (the size of their prefix trie)."""
    total, previous = 0, ()
    for sequence in sorted(tuple(s) for s in sequences):
        common = 0
        while common < min(len(previous), len(sequence)) and previous[common] == sequence[common]:
            common += 1
        total += len(sequence) - common
        previous = sequence
    return total


class TreeRollout:
    """A TRL ``rollout_func`` (``rollout_func(prompts, trainer)``) that returns multi-turn tree rollouts.

    ``branching[d]`` is how many turns are sampled after each node of depth ``d`` (depth 0: the prompt); the last
    depth answers, earlier ones call the calculator. Each tree gives ``group_size`` rows, one per turn. Sampling
    is seeded by ``seed``, the call number and the group's position, so two trainers with the same weights get
    the same batch. ``stats`` keeps, per call, the token counts of the returned rows."""

    def __init__(self, branching=(2, 3), seed: int = 0):
        if not branching or any(b < 1 for b in branching):
            raise ValueError(f"branching must be positive counts per depth, got {branching}")
        self.branching = tuple(branching)
        self.seed = seed
        self.calls = 0
        self.stats: list[dict] = []

    @property
    def group_size(self) -> int:
        """Rows per prompt: one per turn of the tree (2,3 -> 2 + 6)."""
        total, width = 0, 1
        for b in self.branching:
            width *= b
            total += width
        return total

    def max_completion_length(self, observation_tokens: int = 32) -> int:
        depth = len(self.branching)
        turn = TurnGrammar.max_turn_tokens(False)
        return (depth - 1) * (turn - THINK_MAX - 2 + observation_tokens) + TurnGrammar.max_turn_tokens(True)

    def __call__(self, prompts, trainer) -> dict:
        model = trainer.accelerator.unwrap_model(trainer.model)
        return self.rollout(prompts, model, trainer.processing_class, trainer.temperature)

    # -- one tree
    def _grow(self, model, tokenizer, grammar, prompt_ids, generator, temperature) -> list[Turn]:
        """Sample the tree of one prompt level by level; returns its turns (nodes) in breadth-first order."""
        frontier: list[tuple[list[int], Turn | None]] = [([], None)]  # (history after the prompt, parent)
        nodes = []
        for depth, count in enumerate(self.branching):
            final = depth == len(self.branching) - 1
            next_frontier = []
            for history, parent in frontier:
                for ids, logps, text in sample_turns(model, prompt_ids + history, count, final, grammar,
                                                     generator, temperature):
                    node = Turn(history, ids, logps, text, final)
                    nodes.append(node)
                    if parent is not None:
                        parent.children.append(node)
                    if not final:  # later turns see the action only (thinking dropped) and the tool's reply
                        action_ids = tokenizer(node.action, add_special_tokens=False)["input_ids"] + [grammar.eos]
                        reply = tokenizer.apply_chat_template([{"role": "tool", "content": observe(node.action)}],
                                                              add_generation_prompt=True, tokenize=False)
                        reply_ids = tokenizer("\n" + reply, add_special_tokens=False)["input_ids"]
                        next_frontier.append((history + action_ids + reply_ids, node))
            frontier = next_frontier
        return nodes

    def rollout(self, prompts, model, tokenizer, temperature: float = 1.0) -> dict:
        """Rows for ``prompts`` (each prompt repeated ``group_size`` times in a row, as TRL passes them)."""
        grammar = TurnGrammar(tokenizer)
        keys = [json.dumps(p, sort_keys=True) for p in prompts]
        runs, start = [], 0
        for i in range(1, len(keys) + 1):
            if i == len(keys) or keys[i] != keys[start]:
                runs.append((start, i))
                start = i
        output = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": [], "subtree_answers": []}
        was_training = model.training
        model.eval()
        try:
            group = 0
            for start, end in runs:
                if (end - start) % self.group_size:
                    raise ValueError(f"prompt {prompts[start]!r} comes {end - start} times in a row; the tree "
                                     f"rollout needs a multiple of {self.group_size} (num_generations)")
                prompt = prompts[start]
                text = prompt if isinstance(prompt, str) else tokenizer.apply_chat_template(
                    prompt, add_generation_prompt=True, tokenize=False)
                prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
                for _ in range((end - start) // self.group_size):
                    generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.calls * 10_007 + group)
                    group += 1
                    for node in self._grow(model, tokenizer, grammar, prompt_ids, generator, temperature):
                        output["prompt_ids"].append(list(prompt_ids))
                        output["completion_ids"].append(node.history + node.ids)
                        output["env_mask"].append([0] * len(node.history) + [1] * len(node.ids))
                        output["logprobs"].append([0.0] * len(node.history) + node.logprobs)
                        output["subtree_answers"].append(node.answers())
        finally:
            model.train(was_training)
        self.calls += 1
        rows = [p + c for p, c in zip(output["prompt_ids"], output["completion_ids"])]
        path = sum(len(r) for r in rows)
        self.stats.append({
            "path_tokens": path,
            "unique_tokens": shared_token_count(rows),
            # plain GRPO groups: each row's completion sampled on its own, only the prompts shared
            "unique_tokens_prompt_only": shared_token_count(output["prompt_ids"])
                                         + sum(len(c) for c in output["completion_ids"]),
        })
        return output


# ---------------------------------------------------------------------------------------------- training
def _step_printer(rollout: TreeRollout, history: list[dict], start: list[float]):
    from transformers import TrainerCallback

    class StepPrinter(TrainerCallback):
        """One line per logging step: reward, exact answers, the trainer's tree/R_tok and the rollout's counts."""

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not logs or "reward" not in logs:
                return
            stats = rollout.stats[-1]
            entry = {
                "step": state.global_step, "reward": logs["reward"], "reward_std": logs.get("reward_std"),
                "exact": logs.get("exact", 0.0), "loss": logs.get("loss"), "tree/R_tok": logs.get("tree/R_tok"),
                "tree/path_tokens": logs.get("tree/path_tokens"), "tree/unique_tokens": logs.get("tree/unique_tokens"),
                "rollout_R_tok": stats["path_tokens"] / stats["unique_tokens"],
                "prompt_only_R_tok": stats["path_tokens"] / stats["unique_tokens_prompt_only"],
                "seconds": time.perf_counter() - start[0],
            }
            history.append(entry)
            if len(history) == 1:
                print(f"{'step':>5} {'reward':>7} {'std':>6} {'exact':>6} {'R_tok':>6} {'R_tok prompt-only':>18} "
                      f"{'path':>6} {'unique':>6} {'sec':>6}")
            r_tok = entry["tree/R_tok"]
            print(f"{entry['step']:>5} {entry['reward']:>7.3f} {entry['reward_std'] or 0:>6.3f} {entry['exact']:>6.2f} "
                  f"{'-' if r_tok is None else format(r_tok, '.2f'):>6} {entry['prompt_only_R_tok']:>18.2f} "
                  f"{stats['path_tokens']:>6} {stats['unique_tokens']:>6} {entry['seconds']:>6.1f}", flush=True)

    return StepPrinter()


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps (default: %(default)s)")
    parser.add_argument("--out", default="outputs/agentic-tree-rollouts",
                        help="trainer output folder; history.json goes here (default: %(default)s)")
    parser.add_argument("--use-tree", dest="use_tree", action="store_true", default=True,
                        help="log-probs over prefix trees, shared tokens computed once (the default)")
    parser.add_argument("--no-tree", dest="use_tree", action="store_false",
                        help="TRL's own per-row log-prob code (same rows, same loss)")
    parser.add_argument("--branching", default="2,3",
                        help="turns sampled after each node, per depth; the last depth answers (default: %(default)s)")
    parser.add_argument("--prompts-per-step", type=int, default=2, help="(default: %(default)s)")
    parser.add_argument("--learning-rate", type=float, default=1e-2, help="(default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL
    from transformers import PrinterCallback, set_seed

    from harts_hf import TreeGRPOConfig, TreeGRPOTrainer
    from tests.models import build
    from tests.trl_helpers import char_tokenizer

    set_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rollout = TreeRollout(tuple(int(b) for b in args.branching.split(",")), seed=args.seed)
    tokenizer = char_tokenizer()
    model = build("qwen3_next", seed=args.seed)
    model.config.router_aux_loss_coef = 0.0  # dense model: TRL must not ask for router logits
    config = TreeGRPOConfig(
        output_dir=str(out), use_tree=args.use_tree, max_steps=args.steps, learning_rate=args.learning_rate,
        num_generations=rollout.group_size, per_device_train_batch_size=rollout.group_size * args.prompts_per_step,
        max_completion_length=rollout.max_completion_length(), temperature=1.0, beta=0.0, logging_steps=1,
        bf16=False, use_cpu=True, report_to="none", save_strategy="no", seed=args.seed,
        gradient_checkpointing=False, disable_tqdm=True)
    trainer = TreeGRPOTrainer(model, reward_funcs=tree_reward, args=config, train_dataset=puzzle_dataset(64, args.seed),
                              processing_class=tokenizer, rollout_func=rollout)
    history, start = [], [time.perf_counter()]
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(_step_printer(rollout, history, start))
    print(f"tree rollouts: branching {rollout.branching}, {rollout.group_size} rows per prompt, "
          f"{args.prompts_per_step} prompts per step, use_tree={args.use_tree}")
    trainer.train()
    seconds = time.perf_counter() - start[0]

    summary = {
        "steps": len(history), "use_tree": args.use_tree, "branching": list(rollout.branching), "seconds": seconds,
        "mean_reward": sum(h["reward"] for h in history) / max(len(history), 1),
        "mean_exact": sum(h["exact"] for h in history) / max(len(history), 1),
        "mean_rollout_R_tok": sum(h["rollout_R_tok"] for h in history) / max(len(history), 1),
        "mean_prompt_only_R_tok": sum(h["prompt_only_R_tok"] for h in history) / max(len(history), 1),
    }
    trained = [h["tree/R_tok"] for h in history if h["tree/R_tok"] is not None]
    summary["mean_R_tok"] = sum(trained) / len(trained) if trained else None
    (out / "history.json").write_text(json.dumps({"summary": summary, "steps": history}, indent=1))
    first, last = history[0]["reward"], history[-1]["reward"]
    print(f"\n{len(history)} steps in {seconds:.1f} s; reward {first:.3f} -> {last:.3f} "
          f"(mean {summary['mean_reward']:.3f}, exact answers {summary['mean_exact']:.2f})")
    if summary["mean_R_tok"] is not None:
        print(f"mean tree/R_tok over the run: {summary['mean_R_tok']:.2f}  "
              f"(the same rows as plain GRPO groups, sharing only the prompt: {summary['mean_prompt_only_R_tok']:.2f})")
    else:
        print(f"--no-tree: no tree forwards; the rows' prefix trees would give R_tok {summary['mean_rollout_R_tok']:.2f} "
              f"(prompt-only sharing: {summary['mean_prompt_only_R_tok']:.2f})")
    print(f"history: {out / 'history.json'}")
    return summary


if __name__ == "__main__":
    torch.set_num_threads(min(2, torch.get_num_threads()))
    main()
