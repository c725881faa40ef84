"""TreeGRPOTrainer against TRL's GRPOTrainer on the same generated batch: loss, every gradient, a few steps."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM
from trl import GRPOConfig, GRPOTrainer

from harts_hf import TreeGRPOConfig, TreeGRPOTrainer
from tests.models import build
from tests.trl_helpers import char_tokenizer, length_reward, patch_generate, prompt_dataset

BASE_ARGS = dict(per_device_train_batch_size=12, num_generations=6, max_completion_length=40, learning_rate=1e-2,
                 optim="sgd", bf16=False, use_cpu=True, report_to="none", logging_steps=1, save_strategy="no",
                 seed=0, disable_dropout=True, temperature=0.9)


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    """A tiny MoE Qwen3-Next saved to disk (TRL builds the reference model from the policy's path)."""
    path = tmp_path_factory.mktemp("tiny_qwen3_next")
    model = build("qwen3_next_moe")
    model.config.router_aux_loss_coef = 0.01
    model.save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return str(path)


def make_trainers(path, tmp_path, **overrides):
    tokenizer = char_tokenizer()
    args = dict(BASE_ARGS, output_dir=str(tmp_path), **overrides)
    dataset = prompt_dataset(8)
    models = [patch_generate(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), tokenizer) for _ in range(2)]
    base = GRPOTrainer(models[0], reward_funcs=length_reward, args=GRPOConfig(**args), train_dataset=dataset,
                       processing_class=tokenizer)
    tree = TreeGRPOTrainer(models[1], reward_funcs=length_reward, train_dataset=dataset, processing_class=tokenizer,
                           args=TreeGRPOConfig(**args, tree_keep_groups_together=False))
    return base, tree


def prepared(trainer, seed=0):
    """The trainer's first microbatch of a generation batch (generation patched, shuffle seeded)."""
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    generation_batch = [trainer.train_dataset[i] for i in range(2) for _ in range(trainer.num_generations)]
    torch.manual_seed(seed)
    return trainer._prepare_inputs(generation_batch)


def assert_same_loss_and_grads(base, tree, tol=1e-5):
    inputs_base, inputs_tree = prepared(base), prepared(tree)
    if tree.args.tree_keep_groups_together:  # rows come in another order; the loss of one microbatch is order-free
        order_base = sorted(range(len(inputs_base["advantages"])), key=lambda r: inputs_base["completion_ids"][r].tolist())
        order_tree = sorted(range(len(inputs_tree["advantages"])), key=lambda r: inputs_tree["completion_ids"][r].tolist())
        torch.testing.assert_close(inputs_tree["advantages"][order_tree], inputs_base["advantages"][order_base])
        inputs_tree_sorted = {k: v[order_tree] if isinstance(v, torch.Tensor) and v.ndim else v for k, v in inputs_tree.items()}
        inputs_base = {k: v[order_base] if isinstance(v, torch.Tensor) and v.ndim else v for k, v in inputs_base.items()}
        inputs_tree = inputs_tree_sorted
    for key in ("old_per_token_logps", "ref_per_token_logps"):
        a, b = inputs_base.get(key), inputs_tree.get(key)
        assert (a is None) == (b is None), key
        if a is not None:
            mask = inputs_base["completion_mask"].bool()
            torch.testing.assert_close(b[mask], a[mask], rtol=tol, atol=tol)
    for key in ("completion_ids", "advantages"):
        torch.testing.assert_close(inputs_tree[key], inputs_base[key])
    loss_base = base.compute_loss(base.model, inputs_base)
    loss_tree = tree.compute_loss(tree.model, inputs_tree)
    torch.testing.assert_close(loss_tree, loss_base, rtol=tol, atol=tol)
    loss_base.backward()
    loss_tree.backward()
    worst = 0.0
    for (name, a), (_, b) in zip(base.model.named_parameters(), tree.model.named_parameters()):
        assert (a.grad is None) == (b.grad is None), name
        if a.grad is None or a.grad.norm() == 0:
            continue
        error = ((a.grad - b.grad).norm() / a.grad.norm()).item()
        worst = max(worst, error)
        assert error < 100 * tol, f"{name}: relative gradient error {error:.2e}"
    return loss_base.item(), worst


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"])
def test_loss_types_match_grpo_trainer(saved_model, tmp_path, loss_type):
    base, tree = make_trainers(saved_model, tmp_path, loss_type=loss_type)
    assert_same_loss_and_grads(base, tree)


@pytest.mark.parametrize("options", [
    dict(importance_sampling_level="sequence"),
    dict(beta=0.1),
    dict(num_iterations=2),
    dict(beta=0.05, num_iterations=2, loss_type="dapo"),
    dict(tree_token_budget=60),
    dict(tree_share_across_groups=False),
    dict(tree_keep_groups_together=True),
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_options_match_grpo_trainer(saved_model, tmp_path, options):
    tree_only = {k: v for k, v in options.items() if k.startswith("tree_")}
    base, tree = make_trainers(saved_model, tmp_path, **{k: v for k, v in options.items() if k not in tree_only})
    for key, value in tree_only.items():
        setattr(tree.args, key, value)
    assert_same_loss_and_grads(base, tree)
