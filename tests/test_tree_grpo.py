"""TreeGRPOTrainer against TRL's GRPOTrainer on the same generated batch: loss, every gradient, a few steps."""


import pytest
import torch
from transformers import AutoModelForCausalLM
from trl import GRPOConfig, GRPOTrainer

from harts_hf import TreeGRPOConfig, TreeGRPOTrainer
from harts_hf.model_patches import checkpointed_layers
from tests.trl_helpers import (
    assert_same_training,
    char_tokenizer,
    cpu_safe_trainer,
    length_reward,
    patch_generate,
    prompt_dataset,
    save_tiny_model,
    worst_gradient_error,
)

BASE_ARGS = dict(per_device_train_batch_size=12, num_generations=6, max_completion_length=40, learning_rate=1e-2,
                 optim="sgd", bf16=False, use_cpu=True, report_to="none", logging_steps=1, save_strategy="no",
                 seed=0, disable_dropout=True, temperature=0.9)


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    """A tiny MoE Qwen3-Next saved to disk (TRL builds the reference model from the policy's path)."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_next"), "qwen3_next_moe", router_aux_loss_coef=0.01)


def make_trainers(path, tmp_path, tree_args=(), peft_config=None, dataset=None, **overrides):
    """TRL's GRPOTrainer and TreeGRPOTrainer on two copies of the model; ``peft_config``: a function returning a
    PEFT config, given to both (LoRA B initialised to the same random values in both, so adapters act);
    ``dataset``: the prompts (default ``prompt_dataset(8)``)."""
    tokenizer = char_tokenizer()
    args = dict(BASE_ARGS, output_dir=str(tmp_path), **overrides)
    dataset = prompt_dataset(8) if dataset is None else dataset
    models = [patch_generate(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), tokenizer) for _ in range(2)]
    peft = {} if peft_config is None else {"peft_config": peft_config()}
    base = cpu_safe_trainer(GRPOTrainer(models[0], reward_funcs=length_reward, args=GRPOConfig(**args),
                                        train_dataset=dataset, processing_class=tokenizer, **peft))
    peft = {} if peft_config is None else {"peft_config": peft_config()}
    tree = TreeGRPOTrainer(models[1], reward_funcs=length_reward, train_dataset=dataset, processing_class=tokenizer,
                           args=TreeGRPOConfig(**args, tree_keep_groups_together=False, **dict(tree_args)), **peft)
    if peft_config is not None:
        generator = torch.Generator().manual_seed(1)
        for (name, a), (other, b) in zip(base.model.named_parameters(), tree.model.named_parameters()):
            assert name == other
            if "lora_B" in name:
                value = 0.1 * torch.randn(a.shape, generator=generator)
                a.data.copy_(value)
                b.data.copy_(value)
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
        def row_key(inputs):
            return lambda r: (inputs["prompt_ids"][r].tolist(), inputs["completion_ids"][r].tolist())

        order_base = sorted(range(len(inputs_base["advantages"])), key=row_key(inputs_base))
        order_tree = sorted(range(len(inputs_tree["advantages"])), key=row_key(inputs_tree))
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
    worst = worst_gradient_error(base.model, tree.model, 100 * tol)
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
    dict(tree_share_across_groups=False),
    dict(tree_keep_groups_together=True),
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_options_match_grpo_trainer(saved_model, tmp_path, options):
    tree_only = {k: v for k, v in options.items() if k.startswith("tree_")}
    base, tree = make_trainers(saved_model, tmp_path, **{k: v for k, v in options.items() if k not in tree_only})
    for key, value in tree_only.items():
        setattr(tree.args, key, value)
    assert_same_loss_and_grads(base, tree)


def lora_config():
    from peft import LoraConfig

    # Gated DeltaNet's fused projections and output projection, the attention projections
    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                      target_modules=["in_proj_qkvz", "in_proj_ba", "out_proj", "q_proj", "v_proj", "o_proj"])


@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_lora_matches_grpo_trainer(saved_model, tmp_path, beta):
    """PEFT LoRA (``peft_config``): the loss and every adapter gradient are GRPOTrainer's; with beta > 0 TRL's
    reference log-probs come from the same model with its adapters disabled, through the tree as well."""
    base, tree = make_trainers(saved_model, tmp_path, peft_config=lora_config, beta=beta)
    assert type(tree.model).__name__ == "PeftModel"
    assert_same_loss_and_grads(base, tree)
    trained = [name for name, p in tree.model.named_parameters() if p.grad is not None]
    assert trained and all("lora_" in name for name in trained)


def test_lora_training_steps_give_the_same_adapters(saved_model, tmp_path):
    base, tree = make_trainers(saved_model, tmp_path, peft_config=lora_config, max_steps=2,
                               per_device_train_batch_size=6, gradient_accumulation_steps=2)
    assert_same_training(base, tree)


def test_stored_layers_match_grpo_trainer(saved_model, tmp_path):
    """tree_stored_layers: the stored layers stay out of checkpointing through the trainer's own enabling, and
    the loss and gradients are GRPOTrainer's (which checkpoints every layer)."""
    base, tree = make_trainers(saved_model, tmp_path, tree_args=dict(tree_stored_layers=2))
    for trainer in (base, tree):  # as Trainer.train() does
        trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert checkpointed_layers(base.model) == [0, 1, 2, 3]
    assert checkpointed_layers(tree.model) == [0, 2]  # the two attention layers keep their activations
    assert_same_loss_and_grads(base, tree)


def test_kept_matmul_outputs_match_grpo_trainer(saved_model, tmp_path):
    """tree_keep_matmul_layers: the chosen layers keep their products through the trainer's own enabling, and the
    loss and gradients are GRPOTrainer's."""
    base, tree = make_trainers(saved_model, tmp_path, tree_args=dict(tree_keep_matmul_layers=2))
    for trainer in (base, tree):  # as Trainer.train() does
        trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert checkpointed_layers(tree.model) == [0, 1, 2, 3]
    assert tree.model._set_gradient_checkpointing.matmul_layers == [1, 3]  # the attention layers
    assert_same_loss_and_grads(base, tree)


def test_kept_matmul_outputs_within_a_budget_match_grpo_trainer(saved_model, tmp_path):
    """tree_keep_matmul_gib: as many layers as fit at tree_token_budget tokens (here every layer), the same loss and
    gradients as GRPOTrainer's."""
    base, tree = make_trainers(saved_model, tmp_path, tree_args=dict(tree_keep_matmul_gib=1.0, tree_token_budget=64),
                               router_aux_loss_coef=0.0)  # the MoE aux loss cannot be split over pieces
    for trainer in (base, tree):  # as Trainer.train() does
        trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert tree.model._set_gradient_checkpointing.matmul_layers == [0, 1, 2, 3]
    assert_same_loss_and_grads(base, tree)


def test_kept_mixer_outputs_match_grpo_trainer(saved_model, tmp_path):
    """tree_keep_mixer_outputs: put in force through the trainer's own enabling of checkpointing; the loss and
    gradients are GRPOTrainer's (on the CPU the torch nodes have no kept body; the fla nodes' are checked under
    Triton's interpreter)."""
    base, tree = make_trainers(saved_model, tmp_path, tree_args=dict(tree_keep_mixer_outputs=True))
    for trainer in (base, tree):  # as Trainer.train() does
        trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert tree.model._set_gradient_checkpointing.mixer_layers == [0, 2]  # the Gated DeltaNet layers
    assert_same_loss_and_grads(base, tree)


def test_executed_mixers_match_grpo_trainer(saved_model, tmp_path, monkeypatch):
    """tree_executed_mixers: the Gated DeltaNet layers whole in their kernel's executed layout, put in force by the
    trainer's config; the loss and gradients are GRPOTrainer's."""
    from harts_hf.model_patches import gated_deltanet

    monkeypatch.setattr(gated_deltanet, "EXECUTED_LAYOUT", False)
    base, tree = make_trainers(saved_model, tmp_path, tree_args=dict(tree_executed_mixers=True))
    assert gated_deltanet.EXECUTED_LAYOUT
    assert_same_loss_and_grads(base, tree)


def test_kept_mixer_outputs_within_a_budget_match_grpo_trainer(saved_model, tmp_path):
    """tree_keep_mixer_gib: as many mixer layers as fit at tree_token_budget tokens (here one of two), the same loss
    and gradients as GRPOTrainer's."""
    from harts_hf.model_patches import mixer_output_bytes_per_token

    per_token = max(mixer_output_bytes_per_token(AutoModelForCausalLM.from_pretrained(saved_model), torch.float32))
    base, tree = make_trainers(saved_model, tmp_path, router_aux_loss_coef=0.0,
                               tree_args=dict(tree_keep_mixer_gib=1.5 * per_token * 64 / 2**30, tree_token_budget=64))
    for trainer in (base, tree):  # as Trainer.train() does
        trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert tree.model._set_gradient_checkpointing.mixer_layers == [2]
    assert_same_loss_and_grads(base, tree)


def test_training_steps_give_the_same_parameters(saved_model, tmp_path):
    """Three optimizer steps of two microbatches each (generation every step, siblings shuffled as TRL does)."""
    base, tree = make_trainers(saved_model, tmp_path, max_steps=3, per_device_train_batch_size=6,
                               gradient_accumulation_steps=2)
    start = {name: p.detach().clone() for name, p in base.model.named_parameters()}
    for trainer in (base, tree):
        torch.manual_seed(0)  # the same row shuffles in both runs
        trainer.train()
    errors = {}
    for (name, a), (_, b) in zip(base.model.named_parameters(), tree.model.named_parameters()):
        step_base, step_tree = a.detach() - start[name], b.detach() - start[name]
        if step_base.norm() > 0:
            errors[name] = ((step_tree - step_base).norm() / step_base.norm()).item()
        # the same parameters, up to fp32 noise on the parameter and on the step it took
        assert (b - a).norm() <= 1e-5 * a.norm() + 1e-3 * step_base.norm(), name
    logged = [entry for entry in tree.state.log_history if "tree/R_tok" in entry]
    assert len(logged) == 3
    assert all(entry["tree/R_tok"] > 1.5 and entry["tree/unique_tokens"] < entry["tree/path_tokens"] for entry in logged)
    assert all(key in logged[0] for key in ("tree/rounds", "tree/replay_tokens", "tree/R_att"))


def branching_rollout(prompts, trainer):
    """A rollout_func whose groups are real trees, with an identical pair and one completion that is all padding.

    (An empty completion list is not tested here: TRL 1.16 itself indexes ``ids[-1]`` on it; the EOS-only
    completion of ``patch_generate`` covers the empty answer.)"""
    tokenizer = trainer.processing_class
    eos = tokenizer.eos_token_id
    from tests.trl_helpers import CHARS, SPECIAL, branching_completions

    output = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
    seen = {}
    for prompt in prompts:  # TRL passes one entry per completion (each prompt num_generations times)
        ids = tokenizer(prompt)["input_ids"]
        k = seen[prompt] = seen.get(prompt, -1) + 1
        if k == 3:
            completion = [tokenizer.pad_token_id] * 3
        else:
            completion = branching_completions(tuple(ids), k, eos, len(SPECIAL), len(SPECIAL) + len(CHARS))
        output["prompt_ids"].append(ids)
        output["completion_ids"].append(completion)
        output["logprobs"].append([0.0] * len(completion))
    return output


def test_rollout_func_with_branching_and_empty_completions(saved_model, tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    tokenizer = char_tokenizer()
    args = dict(BASE_ARGS, output_dir=str(tmp_path))
    trainers = []
    for trainer_class, config_class, extra in [(GRPOTrainer, GRPOConfig, {}),
                                               (TreeGRPOTrainer, TreeGRPOConfig, {"tree_keep_groups_together": False})]:
        model = AutoModelForCausalLM.from_pretrained(saved_model, dtype=torch.float32)
        trainers.append(trainer_class(model, reward_funcs=length_reward, args=config_class(**args, **extra),
                                      train_dataset=prompt_dataset(8), processing_class=tokenizer,
                                      rollout_func=branching_rollout))
    base, tree = map(cpu_safe_trainer, trainers)
    loss, _ = assert_same_loss_and_grads(base, tree)
    assert torch.isfinite(torch.tensor(loss))


@pytest.mark.parametrize("keep_groups", [False, True])
def test_several_steps_per_generation(saved_model, tmp_path, keep_groups, caplog):
    """steps_per_generation=2 > gradient_accumulation_steps=1: each optimizer step takes half the generation batch.
    With tree_keep_groups_together=False the rows and the loss of each step are GRPOTrainer's; with the default
    each step gets one whole prompt group (GRPOTrainer draws rows at random), said once in the log."""
    from transformers.utils import logging as hf_logging

    base, tree = make_trainers(saved_model, tmp_path, per_device_train_batch_size=6, steps_per_generation=2,
                               gradient_accumulation_steps=1)
    tree.args.tree_keep_groups_together = keep_groups
    hf_logging.enable_propagation()
    try:
        with caplog.at_level("WARNING"):
            if not keep_groups:
                assert_same_loss_and_grads(base, tree)
            else:
                inputs = prepared(tree)
                assert len({tuple(row.tolist()) for row in inputs["prompt_ids"]}) == 1  # one whole group
                base_inputs = prepared(base)
                assert len({tuple(row.tolist()) for row in base_inputs["prompt_ids"]}) == 2  # TRL mixes rows
    finally:
        hf_logging.disable_propagation()
    said = "each optimizer step trains on whole prompt groups" in caplog.text
    assert said == keep_groups


def test_group_shuffle_keeps_groups_together():
    from harts_hf.trainers.grpo import _group_permutation

    prompts = torch.tensor([[0, 5], [0, 5], [6, 7], [6, 7], [0, 5], [6, 7]])
    completions = torch.tensor([[3, 1], [1, 2], [2, 2], [1, 1], [1, 1], [3, 3]])
    batch = {"prompt_ids": prompts, "prompt_mask": torch.tensor([[0, 1]] * 6), "completion_ids": completions,
             "completion_mask": torch.ones(6, 2, dtype=torch.long)}
    order = _group_permutation(batch).tolist()
    assert sorted(order) == list(range(6))
    groups = [prompts[i].tolist() for i in order]
    assert groups[:3] == [groups[0]] * 3 and groups[3:] == [groups[3]] * 3  # contiguous groups
    for half in (order[:3], order[3:]):  # siblings in token order (shared prefixes adjacent)
        assert [completions[i].tolist() for i in half] == sorted(completions[i].tolist() for i in half)


# ---------------------------------------------------------------------------- bad input
def test_unsupported_model_type_and_switch_off(tmp_path):
    import transformers

    config = transformers.BloomConfig(vocab_size=70, hidden_size=16, n_layer=1, n_head=2)  # ALiBi: positions from the mask
    model = transformers.BloomForCausalLM(config)
    args = dict(BASE_ARGS, output_dir=str(tmp_path))
    with pytest.raises(ValueError) as info:
        TreeGRPOTrainer(model, reward_funcs=length_reward, args=TreeGRPOConfig(**args), train_dataset=prompt_dataset(4),
                        processing_class=char_tokenizer())
    assert "qwen3_next" in str(info.value) and "use_tree=False" in str(info.value)
    trainer = TreeGRPOTrainer(model, reward_funcs=length_reward, args=TreeGRPOConfig(**args, use_tree=False),
                              train_dataset=prompt_dataset(4), processing_class=char_tokenizer())
    assert all(handle.family is None for handle in trainer._tree_handles)  # CPU safety only, no tree patch
    assert not hasattr(model, "_harts_tree_patch")


@pytest.mark.parametrize("fields, words", [
    (dict(use_liger_kernel=True), ["use_liger_kernel=False", "use_tree=False"]),
    (dict(tree_token_budget=0), ["tree_token_budget"]),
    (dict(tree_gdn_backend="cuda"), ["tree_gdn_backend", "'fla'"]),
    (dict(tree_attention_backend="flex"), ["tree_attention_backend"]),
    (dict(tree_varlen_kernel="fa3"), ["tree_varlen_kernel", "'fa4'", "'fa3'"]),
    (dict(tree_autocast_experts="bf16"), ["tree_autocast_experts", "'never'", "'bf16'"]),
    (dict(tree_mamba_scan_inputs="bf16"), ["tree_mamba_scan_inputs", "'half'", "'bf16'"]),
    (dict(tree_mamba_chunk_size=48), ["tree_mamba_chunk_size", "power of two", "'own'", "48"]),
    (dict(tree_mamba_chunk_size="auto"), ["tree_mamba_chunk_size", "'auto'"]),
    (dict(tree_attention_backend="cudnn"), ["tree_attention_backend='cudnn'", "CUDA only", "'auto'"]),
    (dict(tree_attention_backend="varlen"), ["tree_attention_backend='varlen'", "CUDA only"]),
    (dict(tree_gdn_backend="fla"), ["tree_gdn_backend='fla'", "CUDA only"]),
    (dict(tree_cross_replica_handoffs=True), ["tree_cross_replica_handoffs=True", "tree_token_budget"]),
    (dict(tree_head_chunk_size=0), ["tree_head_chunk_size"]),
    (dict(tree_stored_layers=2, gradient_checkpointing=False), ["tree_stored_layers=2", "gradient_checkpointing=True"]),
    (dict(tree_stored_layers=-1), ["tree_stored_layers", ">= 0"]),
    (dict(tree_keep_matmul_layers=2, gradient_checkpointing=False),
     ["tree_keep_matmul_layers=2", "gradient_checkpointing=True"]),
    (dict(tree_keep_matmul_layers=2, gradient_checkpointing_kwargs={"use_reentrant": True}),
     ["tree_keep_matmul_layers=2", "use_reentrant=True", "turn the setting off"]),
    (dict(tree_keep_matmul_layers=-1), ["tree_keep_matmul_layers", ">= 0"]),
    (dict(tree_keep_matmul_gib=4.0), ["tree_keep_matmul_gib=4.0", "tree_token_budget"]),
    (dict(tree_keep_matmul_gib=4.0, tree_token_budget=64, tree_keep_matmul_layers=1),
     ["tree_keep_matmul_layers=1", "tree_keep_matmul_gib=4.0", "set one"]),
    (dict(tree_keep_matmul_gib=-1.0, tree_token_budget=64), ["tree_keep_matmul_gib", ">= 0"]),
    (dict(tree_keep_matmul_gib=4.0, tree_token_budget=64, gradient_checkpointing=False),
     ["tree_keep_matmul_gib=4.0", "gradient_checkpointing=True"]),
    (dict(tree_keep_mixer_outputs=True, gradient_checkpointing=False),
     ["tree_keep_mixer_outputs=True", "gradient_checkpointing=True"]),
    (dict(tree_keep_mixer_outputs=True, gradient_checkpointing_kwargs={"use_reentrant": True}),
     ["tree_keep_mixer_outputs=True", "use_reentrant=True", "turn the setting off"]),
    (dict(tree_keep_mixer_gib=2.0), ["tree_keep_mixer_gib=2.0", "tree_token_budget"]),
    (dict(tree_keep_mixer_gib=2.0, tree_token_budget=64, tree_keep_mixer_outputs=True),
     ["tree_keep_mixer_outputs=True", "tree_keep_mixer_gib=2.0", "set one"]),
    (dict(tree_keep_mixer_gib=-1.0, tree_token_budget=64), ["tree_keep_mixer_gib", ">= 0"]),
    (dict(tree_keep_mixer_gib=2.0, tree_token_budget=64, gradient_checkpointing=False),
     ["tree_keep_mixer_gib=2.0", "gradient_checkpointing=True"]),
    (dict(tree_cost_model="no/such/cost.json"), ["tree_cost_model", "CostModel.save"]),
])
def test_contradictory_config_is_refused(tmp_path, fields, words):
    with pytest.raises(ValueError) as info:
        TreeGRPOConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True, report_to="none", **fields)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize("fields, words", [
    (dict(importance_sampling_level="sequence"), ["token-level loss", "tree_cross_replica_handoffs=False"]),
    (dict(loss_type="luspo"), ["token-level loss"]),
])
def test_cross_replica_handoffs_refuse_sequence_level_losses(saved_model, tmp_path, fields, words):
    model = AutoModelForCausalLM.from_pretrained(saved_model)
    args = TreeGRPOConfig(**dict(BASE_ARGS, output_dir=str(tmp_path), router_aux_loss_coef=0.0, tree_token_budget=30,
                                 tree_cross_replica_handoffs=True, **fields))
    with pytest.raises(ValueError) as info:
        TreeGRPOTrainer(model, reward_funcs=length_reward, args=args, train_dataset=prompt_dataset(4),
                        processing_class=char_tokenizer())
    for word in words:
        assert word in str(info.value)


def test_varlen_kernel_field_sets_the_kernel(saved_model, tmp_path, monkeypatch):
    """tree_varlen_kernel puts the tree attention's varlen kernel in force at construction (process-wide); 'fa4'
    without FlashAttention-4 installed fails there, naming the install."""
    from harts_hf.kernels.tree_attention import varlen

    monkeypatch.setattr(varlen, "KERNEL", "torch")
    model = AutoModelForCausalLM.from_pretrained(saved_model)
    for choice in ("auto", "fa4"):
        args = TreeGRPOConfig(**dict(BASE_ARGS, output_dir=str(tmp_path), router_aux_loss_coef=0.0,
                                     tree_varlen_kernel=choice))
        if choice == "fa4" and not varlen._fa4_importable():
            with pytest.raises(ImportError, match=r"harts_hf\[fa4\]"):
                TreeGRPOTrainer(model, reward_funcs=length_reward, args=args, train_dataset=prompt_dataset(4),
                                processing_class=char_tokenizer())
            continue
        TreeGRPOTrainer(model, reward_funcs=length_reward, args=args, train_dataset=prompt_dataset(4),
                        processing_class=char_tokenizer())
        assert varlen.KERNEL == choice


@pytest.mark.parametrize("field, module, name, start, choices", [
    ("tree_autocast_experts", "model_patches.token_modules", "AUTOCAST_EXPERTS", "cuda", ("never", "always")),
    ("tree_mamba_scan_inputs", "model_patches.mamba2", "SCAN_INPUTS", "fp32", ("half", "cuda", "fp32")),
    ("tree_mamba_chunk_size", "model_patches.mamba2", "CHUNK_SIZE", 64, (128, "own", 32)),
    ("tree_mamba_chunk_size", "model_patches.mamba2", "CHUNK_SIZE", 64, ("32",)),
    ("tree_shared_keys_in_place", "kernels.tree_attention.varlen", "SHARED_KEYS_IN_PLACE", False, (True, False)),
    ("tree_executed_mixers", "model_patches.gated_deltanet", "EXECUTED_LAYOUT", False, (True, False)),
])
def test_process_setting_fields_set_their_setting(saved_model, tmp_path, monkeypatch, field, module, name, start,
                                                  choices):
    """tree_autocast_experts (where routed experts run in the autocast dtype), tree_mamba_scan_inputs (the dtype of
    Mamba-2's scan inputs), tree_mamba_chunk_size (its chunk grid; 'own' is None), tree_shared_keys_in_place (shared key
    segments attended in place) and tree_executed_mixers (recurrent mixers whole in their kernel's executed layout) put
    their setting in force at construction (process-wide); None leaves it."""
    import importlib

    settings = importlib.import_module(f"harts_hf.{module}")
    monkeypatch.setattr(settings, name, start)
    model = AutoModelForCausalLM.from_pretrained(saved_model)
    for choice, expected in ((None, start), *((c, {"own": None, "32": 32}.get(c, c)) for c in choices)):
        args = TreeGRPOConfig(**dict(BASE_ARGS, output_dir=str(tmp_path), router_aux_loss_coef=0.0,
                                     **{field: choice}))
        TreeGRPOTrainer(model, reward_funcs=length_reward, args=args, train_dataset=prompt_dataset(4),
                        processing_class=char_tokenizer())
        assert getattr(settings, name) == expected


def test_plain_grpo_config_is_refused(saved_model, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(saved_model)
    with pytest.raises(TypeError, match="TreeGRPOConfig"):
        TreeGRPOTrainer(model, reward_funcs=length_reward, args=GRPOConfig(**dict(BASE_ARGS, output_dir=str(tmp_path))),
                        train_dataset=prompt_dataset(4), processing_class=char_tokenizer())


def identical_rollout(prompts, trainer):
    """Every completion of a group is the same: zero reward spread, multiplicity = group size."""
    tokenizer = trainer.processing_class
    completion = tokenizer("42")["input_ids"] + [tokenizer.eos_token_id]
    ids = [tokenizer(prompt)["input_ids"] for prompt in prompts]
    return {"prompt_ids": ids, "completion_ids": [list(completion) for _ in prompts],
            "logprobs": [[0.0] * len(completion) for _ in prompts]}


def test_group_with_identical_completions(saved_model, tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    tokenizer = char_tokenizer()
    trainers = []
    for trainer_class, config_class in [(GRPOTrainer, GRPOConfig), (TreeGRPOTrainer, TreeGRPOConfig)]:
        model = AutoModelForCausalLM.from_pretrained(saved_model, dtype=torch.float32)
        trainers.append(trainer_class(model, reward_funcs=length_reward, train_dataset=prompt_dataset(8),
                                      processing_class=tokenizer, rollout_func=identical_rollout,
                                      args=config_class(**dict(BASE_ARGS, output_dir=str(tmp_path), beta=0.1))))
    loss, _ = assert_same_loss_and_grads(*map(cpu_safe_trainer, trainers))
    assert torch.isfinite(torch.tensor(loss))
    for parameter in trainers[1].model.parameters():
        assert parameter.grad is None or torch.isfinite(parameter.grad).all()


def _gpt2(**dropouts):
    import transformers

    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=128, **dropouts)
    return transformers.GPT2LMHeadModel(config)


def _tree_trainer(model, tmp_path, **fields):
    return TreeGRPOTrainer(model, reward_funcs=length_reward, train_dataset=prompt_dataset(8),
                           processing_class=char_tokenizer(),
                           args=TreeGRPOConfig(**dict(BASE_ARGS, output_dir=str(tmp_path), **fields)))


def test_attention_dropout_is_refused_when_the_trainer_is_built(tmp_path):
    """GPT-2's defaults drop attention weights (attn_pdrop 0.1): refused at construction, naming the module and
    TRL's switch, which clears it; a rate the attention holds as a number (Llama's attention_dropout, which TRL's
    switch does not reach) names the loading argument."""
    import transformers

    with pytest.raises(ValueError, match=r"TreeGRPOTrainer: GPT2Attention\.attn_dropout drops attention weights with "
                                         r"p=0\.1; .*disable_dropout=True in TreeGRPOConfig"):
        _tree_trainer(_gpt2(), tmp_path, disable_dropout=False)
    _tree_trainer(_gpt2(), tmp_path / "off", disable_dropout=True)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=1, attention_dropout=0.1))
    with pytest.raises(ValueError, match=r"LlamaAttention\.attention_dropout is 0\.1; .*attention_dropout=0\.0"):
        _tree_trainer(llama, tmp_path / "llama", disable_dropout=True)


def test_other_dropout_is_said_when_the_trainer_is_built(tmp_path, caplog):
    """Residual and embedding dropout run once per unique token (one mask per shared token): said, not silent."""
    import harts_hf.trainers.grpo as grpo

    with caplog.at_level("WARNING", logger=grpo.__name__):
        _tree_trainer(_gpt2(attn_pdrop=0.0), tmp_path, disable_dropout=False)
    assert "5 dropout modules are active (transformer.drop, transformer.h.0.attn.resid_dropout" in caplog.text
    assert "draws one dropout mask for all of them" in caplog.text


@pytest.mark.parametrize("family", ["kimi_linear", "bailing_hybrid"])
def test_bf16_on_cpu_trains_as_grpo_trainer(family, tmp_path):
    """``bf16=True, use_cpu=True``: accelerate's bf16 autocast over fp32 weights on the CPU (Kimi Delta Attention's tree
    path once failed there: CPU PyTorch has no bf16 triangular solve). Two steps of both trainers: the same losses and
    grad norms within bf16 rounding of each other (measured: equal losses, grad norms within 0.2%)."""
    path = save_tiny_model(tmp_path / "model", family, router_aux_loss_coef=0.0)
    base, tree = make_trainers(path, tmp_path / "out", bf16=True, max_steps=2)
    logs = []
    for trainer in (base, tree):
        torch.manual_seed(0)
        trainer.train()
        logs.append([(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h])
    assert len(logs[0]) == len(logs[1]) == 2
    for (loss, norm), (tree_loss, tree_norm) in zip(*logs):
        assert abs(tree_loss - loss) <= 1e-3 and abs(tree_norm - norm) <= 1e-2 * norm
