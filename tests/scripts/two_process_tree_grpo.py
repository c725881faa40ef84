"""Run by tests/test_distributed.py under `accelerate launch --multi_gpu --num_processes 2` on CPU (gloo).

Trains a few TreeGRPO steps and writes each rank's final parameters and world size to OUT_DIR/rank<k>.pt.
"""

import sys
from pathlib import Path

import torch
from accelerate import PartialState

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from harts_hf import TreeGRPOConfig, TreeGRPOTrainer  # noqa: E402
from tests.models import build  # noqa: E402
from tests.trl_helpers import char_tokenizer, length_reward, patch_generate, prompt_dataset  # noqa: E402


def main(out_dir: str, keep_groups: str) -> None:
    state = PartialState()
    tokenizer = char_tokenizer()
    model = patch_generate(build("qwen3_next_moe", seed=0), tokenizer)
    args = TreeGRPOConfig(
        output_dir=out_dir, per_device_train_batch_size=6, num_generations=6, max_completion_length=32,
        gradient_accumulation_steps=2, max_steps=2, learning_rate=1e-2, optim="sgd", bf16=False, use_cpu=True,
        report_to="none", logging_steps=1, save_strategy="no", seed=0, router_aux_loss_coef=0.01,
        tree_keep_groups_together=keep_groups == "groups")
    trainer = TreeGRPOTrainer(model, reward_funcs=length_reward, args=args, train_dataset=prompt_dataset(16),
                              processing_class=tokenizer)
    trainer.train()
    params = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    logged = [entry for entry in trainer.state.log_history if "tree/R_tok" in entry]
    torch.save({"world_size": state.num_processes, "params": params, "logged": logged},
               Path(out_dir) / f"rank{state.process_index}.pt")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
