"""Reward-trend parity: the same model, data and seed trained with TreeGRPOTrainer and with GRPOTrainer, plus a
second GRPOTrainer run with another seed to show the baseline's own run-to-run spread.

    python examples/reward_parity.py --steps 120 --out docs/reward_parity      # CPU, a few minutes

A tiny hybrid Qwen3-Next (Gated DeltaNet + attention) with a character tokenizer learns a verifiable task
(answers made only of the letters a-e, rewarded by the share of such letters, with a length target), with real
sampling. Logs reward, loss and grad norm per step to ``<out>/history.json`` and draws ``<out>/reward_parity.png``
(curves and per-step differences).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TARGET = set("abcde")


def letters_reward(completions, **kwargs):
    """Share of completion characters in a-e, times a soft length target of 12 characters."""
    rewards = []
    for text in completions:
        share = sum(ch in TARGET for ch in text) / max(len(text), 1)
        rewards.append(share * min(len(text), 12) / 12)
    return rewards


def train(trainer_name: str, seed: int, steps: int, out: Path) -> list[dict]:
    from transformers import set_seed
    from trl import GRPOConfig, GRPOTrainer

    from harts_hf import TreeGRPOConfig, TreeGRPOTrainer
    from tests.models import build
    from tests.trl_helpers import char_tokenizer, prompt_dataset

    set_seed(seed)
    tokenizer = char_tokenizer()
    model = build("qwen3_next", seed=0, mild_decay=True)
    model.config.router_aux_loss_coef = 0.0
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    common = dict(output_dir=str(out / f"{trainer_name}-{seed}"), per_device_train_batch_size=16, num_generations=8,
                  max_completion_length=16, learning_rate=3e-3, max_steps=steps, logging_steps=1, bf16=False,
                  use_cpu=True, report_to="none", save_strategy="no", seed=seed, temperature=1.0, beta=0.0,
                  gradient_checkpointing=False, disable_tqdm=True)
    dataset = prompt_dataset(256, seed=0)
    if trainer_name == "tree":
        trainer = TreeGRPOTrainer(model, reward_funcs=letters_reward, args=TreeGRPOConfig(**common),
                                  train_dataset=dataset, processing_class=tokenizer)
    else:
        trainer = GRPOTrainer(model, reward_funcs=letters_reward, args=GRPOConfig(**common), train_dataset=dataset,
                              processing_class=tokenizer)
    trainer.train()
    return [{k: entry.get(k) for k in ("step", "reward", "loss", "grad_norm", "tree/R_tok")}
            for entry in trainer.state.log_history if "reward" in entry]


def plot(history: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {"TreeGRPOTrainer (seed 0)": history["tree-0"], "GRPOTrainer (seed 0)": history["grpo-0"],
            "GRPOTrainer (seed 1, rerun)": history["grpo-1"]}
    figure, axes = plt.subplots(3, 1, figsize=(9, 10), sharex=True)
    for label, rows in runs.items():
        steps = [r["step"] for r in rows]
        axes[0].plot(steps, [r["reward"] for r in rows], label=label, linewidth=1.2)
        axes[1].plot(steps, [r["grad_norm"] for r in rows], label=label, linewidth=1.0)
    axes[0].set_ylabel("reward")
    axes[0].legend()
    axes[1].set_ylabel("grad norm")
    steps = [r["step"] for r in history["tree-0"]]
    tree = [r["reward"] for r in history["tree-0"]]
    base = [r["reward"] for r in history["grpo-0"]]
    rerun = [r["reward"] for r in history["grpo-1"]]
    axes[2].plot(steps, [t - b for t, b in zip(tree, base)], label="tree - GRPO (same seed)")
    axes[2].plot(steps, [r - b for r, b in zip(rerun, base)], label="GRPO rerun - GRPO", alpha=0.7)
    axes[2].axhline(0, color="black", linewidth=0.5)
    axes[2].set_ylabel("reward difference")
    axes[2].set_xlabel("step")
    axes[2].legend()
    figure.suptitle("Reward trend: TreeGRPOTrainer vs GRPOTrainer (tiny Qwen3-Next, CPU)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--out", default="docs/reward_parity")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    history = {}
    for name, seed in (("tree", 0), ("grpo", 0), ("grpo", 1)):
        history[f"{name}-{seed}"] = train(name, seed, args.steps, out / "runs")
        (out / "history.json").write_text(json.dumps(history, indent=1))
    plot(history, out / "reward_parity.png")
    tree, base = history["tree-0"], history["grpo-0"]
    same = sum(abs(t["reward"] - b["reward"]) < 1e-6 for t, b in zip(tree, base))
    print(f"steps: {len(tree)}; steps where tree and GRPO rewards agree to 1e-6: {same}; "
          f"final reward tree {tree[-1]['reward']:.3f}, GRPO {base[-1]['reward']:.3f}, rerun {history['grpo-1'][-1]['reward']:.3f}")


if __name__ == "__main__":
    main()
