"""TreeGRPOTrainer with a token budget smaller than a microbatch's forest: the microbatch runs as planner pieces
(hand-offs between them), and the loss, every parameter gradient and the logged metrics equal GRPOTrainer's on
the same generated batch; every unique token is computed with gradient exactly once."""

import pytest
import torch
from transformers import AutoModelForCausalLM

import harts_hf.trainers.grpo as grpo_module
from harts_hf import TreeGRPOConfig, TreeGRPOTrainer
from tests.test_tree_grpo import BASE_ARGS, make_trainers, prepared, saved_model  # noqa: F401 (fixture)
from tests.trl_helpers import (
    char_tokenizer,
    length_reward,
    patch_generate,
    prompt_dataset,
    record_executions,
    worst_gradient_error,
)

BUDGET = dict(tree_token_budget=24)  # each group's tree (~60 unique tokens) is cut into several pieces
NO_AUX = dict(router_aux_loss_coef=0.0)  # the MoE load-balancing loss is not split over pieces


@pytest.fixture
def executions(monkeypatch):
    """Stats of every execute_plan call the trainer makes (with the plan's unique token count)."""
    return record_executions(monkeypatch, grpo_module)


def metrics_of(trainer) -> dict:
    return {key: values[-1] for key, values in trainer._metrics["train"].items() if values}


def assert_planned_matches(path, tmp_path, executions, tol=1e-5, tree_args=(), budget=BUDGET["tree_token_budget"],
                           **options):
    base, tree = make_trainers(path, tmp_path, tree_args=tree_args, **NO_AUX, **options)
    tree.args.tree_token_budget = budget
    inputs_base, inputs_tree = prepared(base), prepared(tree)
    torch.testing.assert_close(inputs_tree["advantages"], inputs_base["advantages"])
    for key in ("old_per_token_logps", "ref_per_token_logps"):  # forward-only pieces (no gradient)
        if key in inputs_base:
            mask = inputs_base["completion_mask"].bool()
            torch.testing.assert_close(inputs_tree[key][mask], inputs_base[key][mask], rtol=tol, atol=tol)
    before = {key: len(values) for key, values in base._metrics["train"].items()}
    loss_base = base.compute_loss(base.model, inputs_base)
    loss_base.backward()
    loss_tree = tree.compute_loss(tree.model, inputs_tree)
    loss_tree.backward()  # a detached leaf: the pieces already accumulated the gradients
    torch.testing.assert_close(loss_tree, loss_base.detach(), rtol=tol, atol=tol)
    worst = worst_gradient_error(base.model, tree.model, 10 * tol)
    logged_base, logged_tree = metrics_of(base), metrics_of(tree)
    new_keys = [key for key in logged_base if len(base._metrics["train"][key]) > before.get(key, 0)]
    assert "entropy" in new_keys
    for key in new_keys:
        assert logged_tree[key] == pytest.approx(logged_base[key], rel=1e-4, abs=1e-6), key
    training = [call for call in executions if call["training"]]
    assert training and training[-1]["handoffs"] > 0 and training[-1]["pieces"] > 2
    assert training[-1]["grad_tokens"] == training[-1]["unique"]  # no token computed with gradient twice
    assert tree._tree_metrics["pieces"][-1] == training[-1]["pieces"]
    print(f"\n[planner] pieces={training[-1]['pieces']} handoffs={training[-1]['handoffs']} "
          f"grad_tokens={training[-1]['grad_tokens']} loss_diff={abs(loss_tree - loss_base).item():.2e} "
          f"worst_grad_rel={worst:.2e}")
    return worst


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"])
def test_planned_loss_types_match_grpo_trainer(saved_model, tmp_path, executions, loss_type):  # noqa: F811
    assert_planned_matches(saved_model, tmp_path, executions, loss_type=loss_type)


def test_budget_below_the_longest_run_matches_grpo_trainer(saved_model, tmp_path, executions,  # noqa: F811
                                                          monkeypatch):
    """tree_token_budget=6, below the runs without a branch point in these trees: the planner cuts inside them
    (short of a chunk, with replay), and the loss, gradients and metrics are still GRPOTrainer's."""
    from harts_hf.trees import packed as packed_module

    split = packed_module.PackedForest.split_segments
    cut = []
    monkeypatch.setattr(packed_module.PackedForest, "split_segments",
                        lambda self, *a: cut.append(self is not (out := split(self, *a))) or out)
    assert_planned_matches(saved_model, tmp_path, executions, budget=6, loss_type="dapo")
    assert any(cut)


@pytest.mark.parametrize("options", [
    dict(beta=0.1, num_iterations=2, loss_type="dapo"),
    dict(beta=0.05, entropy_coef=0.02),
    dict(importance_sampling_level="sequence"),  # GSPO: a forward-only pass first, then the gradient pass
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_planned_options_match_grpo_trainer(saved_model, tmp_path, executions, options):  # noqa: F811
    assert_planned_matches(saved_model, tmp_path, executions, **options)
    if options.get("num_iterations") == 2:
        assert any(not call["training"] and call["nograd_forwards"] > 2 for call in executions)  # old log-probs


@pytest.mark.parametrize("options", [dict(loss_type="dapo"), dict(importance_sampling_level="sequence")],
                         ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_kept_source_graphs_match_grpo_trainer(saved_model, tmp_path, executions, options):  # noqa: F811
    """tree_keep_source_graphs: a hand-off source's forward with gradient runs once (no forward without gradient
    for its hand-off) and its graph waits for its children; the loss, gradients and metrics are GRPOTrainer's."""
    assert_planned_matches(saved_model, tmp_path, executions, tree_args=dict(tree_keep_source_graphs=True), **options)
    training = [call for call in executions if call["training"]]
    assert training[-1]["nograd_forwards"] == 0 and training[-1]["grad_forwards"] == training[-1]["pieces"]


def test_kept_source_graphs_need_one_process(saved_model, tmp_path, monkeypatch):  # noqa: F811
    """Under DDP or DeepSpeed each piece's backward must follow its forward: the setting is refused, naming it."""
    _, tree = make_trainers(saved_model, tmp_path, tree_args=dict(tree_keep_source_graphs=True), **NO_AUX)
    tree.args.tree_token_budget = BUDGET["tree_token_budget"]
    inputs = prepared(tree)
    monkeypatch.setattr(type(tree.accelerator), "num_processes", property(lambda self: 2))
    with pytest.raises(ValueError, match="tree_keep_source_graphs=True runs on one process.*2 processes.*"
                                         "set tree_keep_source_graphs=False"):
        tree._check_planner_supported()
    monkeypatch.setattr(type(tree.accelerator), "num_processes", property(lambda self: 1))
    tree.is_deepspeed_enabled = True
    with pytest.raises(ValueError, match="this run has DeepSpeed"):
        tree._check_planner_supported()
    tree.is_deepspeed_enabled = False
    tree.compute_loss(tree.model, inputs).backward()  # one process: runs


def test_lora_on_routed_experts_matches_grpo_trainer(saved_model, tmp_path, executions):  # noqa: F811
    """PEFT LoRA on the routed experts' parameters (``LoraConfig(target_parameters=...)``, TRL's gpt-oss recipe) and on
    the attention's queries, in planner pieces: the loss, every adapter gradient and the logged metrics are
    GRPOTrainer's."""
    from peft import LoraConfig

    def experts_lora():
        return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj"],
                          target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])

    assert_planned_matches(saved_model, tmp_path, executions, peft_config=experts_lora)


def test_microbatch_that_fits_takes_one_tree_forward(saved_model, tmp_path, executions):  # noqa: F811
    base, tree = make_trainers(saved_model, tmp_path, **NO_AUX)
    tree.args.tree_token_budget = 10_000
    tree.compute_loss(tree.model, prepared(tree)).backward()
    assert executions == [] and tree._tree_metrics["pieces"] == [1]


def test_aux_loss_with_budget_is_refused(saved_model, tmp_path):  # noqa: F811
    args = dict(BASE_ARGS, output_dir=str(tmp_path))
    model = AutoModelForCausalLM.from_pretrained(saved_model, dtype=torch.float32)
    with pytest.raises(ValueError) as info:  # at construction
        TreeGRPOTrainer(model, reward_funcs=length_reward, args=TreeGRPOConfig(**args, **BUDGET),
                        train_dataset=prompt_dataset(8), processing_class=char_tokenizer())
    assert "router_aux_loss_coef=0.0" in str(info.value) and "tree_token_budget=None" in str(info.value)
    _, tree = make_trainers(saved_model, tmp_path)  # budget set after construction: refused at first use
    tree.args.tree_token_budget = BUDGET["tree_token_budget"]
    with pytest.raises(ValueError, match="router_aux_loss_coef"):
        tree.compute_loss(tree.model, prepared(tree))


@pytest.mark.parametrize("attribute, stage, words", [
    ("is_deepspeed_enabled", 2, ["DeepSpeed", "fp16", "bf16=True", "tree_token_budget=None"]),
    ("is_deepspeed_enabled", 3, ["DeepSpeed", "fp16", "bf16=True", "tree_token_budget=None"]),
    ("is_fsdp_enabled", None, ["FSDP", "tree_token_budget=None"]),
])
def test_unsupported_engines_are_refused(saved_model, tmp_path, monkeypatch, attribute, stage, words):  # noqa: F811
    """FSDP, and DeepSpeed (ZeRO-2 or 3) with fp16 (its loss scale would apply twice to hand-off gradients).
    DeepSpeed ZeRO-2 and ZeRO-3 in bf16 or fp32 train with pieces (tests/test_deepspeed.py, real DeepSpeed)."""
    import types

    _, tree = make_trainers(saved_model, tmp_path, **NO_AUX)
    tree.args.tree_token_budget = BUDGET["tree_token_budget"]
    inputs = prepared(tree)  # generation first, as the plain trainer (TRL would gather ZeRO-3 weights for it)
    setattr(tree, attribute, True)
    monkeypatch.setattr(type(tree.accelerator), "mixed_precision", property(lambda self: "fp16"))
    plugin = None if stage is None else types.SimpleNamespace(zero_stage=stage)
    monkeypatch.setattr(type(tree.accelerator.state), "deepspeed_plugin", property(lambda self: plugin))
    with pytest.raises(ValueError) as info:
        tree.compute_loss(tree.model, inputs)
    assert all(word in str(info.value) for word in words)


def test_fitted_cost_model_cuts_the_pieces(saved_model, tmp_path, monkeypatch):  # noqa: F811
    """tree_cost_model: the trainer plans its pieces with the saved coefficients (here: only unique tokens count)."""
    from harts_hf.planner import CostModel

    fitted = CostModel(unique_tokens=1.0, attention_pairs=0.0, replay_tokens=0.0, rounds=0.0, leaves=0.0,
                       microbatches=0.0)
    fitted.save(tmp_path / "cost.json")
    used = []
    import harts_hf.planner

    planner = harts_hf.planner.plan
    monkeypatch.setattr(harts_hf.planner, "plan", lambda *a, **k: used.append(k["cost_model"]) or planner(*a, **k))
    args = dict(BASE_ARGS, output_dir=str(tmp_path), **NO_AUX, **BUDGET, tree_cost_model=str(tmp_path / "cost.json"))
    tree = TreeGRPOTrainer(patch_generate(AutoModelForCausalLM.from_pretrained(saved_model, dtype=torch.float32),
                                          char_tokenizer()), reward_funcs=length_reward,
                           args=TreeGRPOConfig(**args), train_dataset=prompt_dataset(8),
                           processing_class=char_tokenizer())
    tree.compute_loss(tree.model, prepared(tree)).backward()
    assert used and all(model == fitted for model in used)


def test_pieces_are_cut_on_the_models_chunk_grid(saved_model, tmp_path, monkeypatch):  # noqa: F811
    """The trainer plans on ``chunk_grid(model)`` (a Mamba-2 model's 128 where it has them; here made 128 by hand)."""
    import harts_hf.planner
    import harts_hf.trainers.grpo

    used = []
    planner = harts_hf.planner.plan
    monkeypatch.setattr(harts_hf.planner, "plan", lambda *a, **k: used.append(k["chunk_size"]) or planner(*a, **k))
    monkeypatch.setattr(harts_hf.trainers.grpo, "chunk_grid", lambda model: 128)
    args = dict(BASE_ARGS, output_dir=str(tmp_path), **NO_AUX, **BUDGET)
    tree = TreeGRPOTrainer(patch_generate(AutoModelForCausalLM.from_pretrained(saved_model, dtype=torch.float32),
                                          char_tokenizer()), reward_funcs=length_reward,
                           args=TreeGRPOConfig(**args), train_dataset=prompt_dataset(8),
                           processing_class=char_tokenizer())
    tree.compute_loss(tree.model, prepared(tree)).backward()
    assert used and set(used) == {128}


def test_out_of_memory_in_a_step_names_the_settings_that_bound_it(saved_model, tmp_path, monkeypatch):  # noqa: F811
    """A CUDA out-of-memory error in a step reaches the user as itself, with a note naming the token budget in force
    and what to change (on 2026-12-05 an 80 GB card fit step 1 at 65,536-token pieces and failed in step 2, once
    AdamW's states existed)."""
    from trl import GRPOTrainer

    _, tree = make_trainers(saved_model, tmp_path, **NO_AUX)

    def out_of_memory(self, model, inputs, num_items_in_batch=None):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 768.00 MiB.")

    monkeypatch.setattr(GRPOTrainer, "training_step", out_of_memory)
    for budget, expected in [(None, "set tree_token_budget"), (65536, "lower tree_token_budget below 65536")]:
        tree.args.tree_token_budget = budget
        tree.args.tree_keep_matmul_layers = 3
        with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate") as caught:
            tree.training_step(tree.model, {}, None)
        note = "\n".join(caught.value.__notes__)
        assert expected in note and "lower tree_keep_matmul_layers (now 3)" in note and "AdamW" in note
        assert "expandable_segments" not in note  # no CUDA here: nothing to say about fragmentation
    from harts_hf.trainers.grpo import out_of_memory_note

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert "33.0 GiB were reserved" in out_of_memory_note(tree.args, 33.0)
    assert "expandable_segments" not in out_of_memory_note(tree.args, 0.5)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert "expandable_segments" not in out_of_memory_note(tree.args, 33.0)
    assert "tree_keep_mixer_outputs" not in out_of_memory_note(tree.args)
    tree.args.tree_keep_mixer_outputs = True
    assert "set tree_keep_mixer_outputs=False" in out_of_memory_note(tree.args)
