"""Contract with TRL's private hooks that TreeGRPOTrainer and TreeSFTTrainer override or rely on (trl>=1.16,<1.17)."""

import inspect

import trl
from trl import GRPOConfig, GRPOTrainer, SFTTrainer
from trl.trainer import utils as trl_utils


def test_overridden_hooks_keep_their_signatures():
    params = list(inspect.signature(GRPOTrainer._get_per_token_logps_and_entropies).parameters)
    assert params[:8] == ["self", "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size",
                          "compute_entropy", "compute_aux_loss"]
    assert list(inspect.signature(GRPOTrainer._prepare_inputs).parameters) == ["self", "generation_batch"]
    assert list(inspect.signature(GRPOTrainer.log).parameters) == ["self", "logs", "start_time"]


def test_private_names_used_exist():
    source = inspect.getsource(GRPOTrainer)
    for name in ("self._step", "self._buffered_inputs", "self.num_iterations", "self.temperature",
                 "self._generate_and_score_completions", "shuffle_sequence_dict", "self.aux_loss_enabled",
                 "self.ref_model", "outputs.log_probs"):
        assert name in source, name
    for name in ("split_tensor_dict", "split_pixel_values_by_grid", "unsplit_pixel_values_by_grid"):
        assert callable(getattr(trl_utils, name)), name
    fields = GRPOConfig.__dataclass_fields__
    for name in ("steps_per_generation", "cast_lm_head_to_fp32", "loss_type", "importance_sampling_level", "beta"):
        assert name in fields, name
    # the hook returns (logps, entropies, aux_loss) laid out as (B, logits_to_keep)
    assert "return logps, entropies, aux_loss" in inspect.getsource(GRPOTrainer._get_per_token_logps_and_entropies)


def test_tested_trl_range():
    major, minor = (int(x) for x in trl.__version__.split(".")[:2])
    assert (major, minor) == (1, 16), f"TreeGRPOTrainer is tested against trl 1.16.x, found {trl.__version__}"


def test_planner_path_contract():
    """compute_loss runs planner pieces with TRL's per-token loss (harts_hf.trainers.piece_loss) and replays TRL's
    _compute_loss for the value and metrics: the formulas, normalisers and attributes it mirrors must not move."""
    import accelerate
    import transformers

    assert list(inspect.signature(GRPOTrainer.compute_loss).parameters) == [
        "self", "model", "inputs", "return_outputs", "num_items_in_batch"]
    assert list(inspect.signature(GRPOTrainer._compute_loss).parameters) == ["self", "model", "inputs"]
    # TreeGRPOTrainer.training_step wraps TRL's (a note on out-of-memory errors), passing these three on
    assert list(inspect.signature(GRPOTrainer.training_step).parameters) == [
        "self", "model", "inputs", "num_items_in_batch"]
    assert GRPOTrainer.loss_is_scaled_for_ga is True  # Trainer.training_step does not rescale our returned loss
    loss_source = inspect.getsource(GRPOTrainer._compute_loss)
    for text in (
        "self._get_per_token_logps_and_entropies(",
        "compute_entropy=True",
        "mask = completion_mask if \"tool_mask\" not in inputs else completion_mask * inputs[\"tool_mask\"]",
        "old_per_token_logps = per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps",
        "torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps) - 1",
        "if self.args.use_bias_correction_kl:",
        "clamped_ratios = torch.clamp(coef_1, max=self.epsilon_high).detach()",
        "per_token_loss = -clamped_ratios * advantages * per_token_logps",
        "coef_2 = torch.clamp(coef_1, 1 - self.epsilon_low, 1 + self.epsilon_high)",
        "coef_1 = torch.clamp(coef_1, max=self.args.delta)",
        "per_token_loss = -torch.min(per_token_loss1, per_token_loss2)",
        "soft_coef_1 = torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures",
        "per_token_loss = per_token_loss * inputs[\"importance_sampling_ratio\"]",
        "per_token_loss = per_token_loss + self.beta * per_token_kl",
        "loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()",
        "loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)",
        "loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * self.max_completion_length)",
        "normalizer = inputs[\"num_items_in_batch\"].clamp(min=1.0) / self.accelerator.num_processes",
        "normalizer = normalizer * self.current_gradient_accumulation_steps / self.args.steps_per_generation",
        "(entropies * effective_mask).sum() / effective_mask.sum().clamp(min=1.0) / accumulation_factor",
        "apply_coef = self.entropy_coef if self._last_world_entropy <= self.args.entropy_target else 0.0",
    ):
        assert text in loss_source, text
    init_source = inspect.getsource(GRPOTrainer.__init__)
    for name in ("self.epsilon_low", "self.epsilon_high", "self.beta", "self.loss_type", "self.max_completion_length",
                 "self.importance_sampling_level", "self.off_policy_mask_threshold", "self.top_entropy_quantile",
                 "self.use_vllm", "self.vllm_importance_sampling_correction", "self._entropy_bonus_enabled",
                 "self.use_adaptive_entropy", "self._last_world_entropy", "self.entropy_coef",
                 "self.router_aux_loss_coef", "self.aux_loss_enabled"):
        assert f"{name} =" in init_source, name
    fields = GRPOConfig.__dataclass_fields__
    for name in ("delta", "sapo_temperature_pos", "sapo_temperature_neg", "use_bias_correction_kl", "entropy_target",
                 "router_aux_loss_coef", "optim"):
        assert name in fields, name
    # Trainer's step: compute_loss, then accelerator.backward of its result (which scales as _PieceLoss scales)
    step_source = inspect.getsource(transformers.Trainer.training_step)
    assert "self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)" in step_source
    assert "self.accelerator.backward(loss" in step_source
    for name in ("is_deepspeed_enabled", "is_fsdp_enabled", "current_gradient_accumulation_steps"):
        assert name in inspect.getsource(transformers.Trainer), name
    backward_source = inspect.getsource(accelerate.Accelerator.backward)
    assert "loss = loss / self.gradient_accumulation_steps" in backward_source
    assert "self.scaler.scale(loss).backward(" in backward_source
    assert "no_sync" in dir(accelerate.Accelerator)


def test_replica_balance_contract():
    """tree_balance_replicas moves every key TRL's generation batch can hold (or keeps TRL's split for the
    multimodal ones); it relies on TRL's padding sides, its global num_items_in_batch, its process slice of the
    advantages and the normalisers of each loss type (see harts_hf.trainers.replica_balance.balance_blocker)."""
    import re

    from harts_hf.trainers.replica_balance import _LAYOUT, MULTIMODAL_KEYS

    source = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    built = set(re.findall(r'output\["(\w+)"\]', source))
    built |= set(re.findall(r'^\s+"(\w+)": \w+,$', source[source.index("output = {"):], flags=re.M))
    assert "prompt_ids" in built and "advantages" in built
    assert built <= set(_LAYOUT) | set(MULTIMODAL_KEYS) | {"importance_sampling_ratio"}, built - set(_LAYOUT)
    for text in ('padding_value=self._tokenizer.pad_token_id,\n            padding_side="left"',
                 'padding_value=self._tokenizer.pad_token_id,\n            padding_side="right"',
                 "num_items_in_batch = self.accelerator.gather(loss_mask.sum()).sum()",
                 "self.accelerator.process_index * len(prompts)", "advantages = advantages[process_slice]",
                 'self.vllm_importance_sampling_mode in ["sequence_mask", "sequence_truncate"]'):
        assert text in source, text
    assert "self.pad_to_multiple_of =" in inspect.getsource(GRPOTrainer.__init__)
    loss_source = inspect.getsource(GRPOTrainer._compute_loss)
    assert 'self.loss_type in ["grpo", "sapo"]' in loss_source and 'self.loss_type in ["cispo", "dapo", "vespo"]' in \
        loss_source and 'self.loss_type == "luspo"' in loss_source and "(per_token_loss * mask).sum(-1).mean()" in \
        loss_source


def test_tree_trainer_takes_grpo_trainers_arguments():
    """TreeGRPOTrainer(...) is called exactly as GRPOTrainer(...): the same parameters in the same order, kinds and
    defaults (reward_funcs=None: an environment that owns the reward passes none)."""
    from harts_hf import TreeGRPOTrainer

    def parameters(cls):
        return [(p.name, p.kind, p.default) for p in inspect.signature(cls.__init__).parameters.values()]

    assert parameters(TreeGRPOTrainer) == parameters(GRPOTrainer)
    assert inspect.signature(TreeGRPOTrainer.__init__).parameters["reward_funcs"].default is None


def test_tree_sft_trainer_planned_and_per_turn_paths():
    """What TreeSFTTrainer mirrors or relies on (trl 1.16, transformers 5): SFTTrainer's argument order (passed on
    positionally), its loss formula and the template it substitutes for assistant_only_loss (self.chat_template), and
    how Trainer.training_step and accelerator.backward scale compute_loss's value (each piece's loss is scaled so)."""
    import accelerate
    from transformers import Trainer

    assert list(inspect.signature(SFTTrainer.__init__).parameters)[:8] == [
        "self", "model", "args", "data_collator", "train_dataset", "eval_dataset", "processing_class",
        "compute_loss_func"]
    mirrored = {
        SFTTrainer.compute_loss: ("per_token_loss = -outputs.log_probs",
                                  "per_token_loss = per_token_loss * outputs.log_probs.exp().detach()",
                                  "num_tokens = outputs.label_mask.sum() if num_items_in_batch is None else "
                                  "num_items_in_batch",
                                  "loss = per_token_loss.sum() / torch.as_tensor(num_tokens).clamp(min=1)",
                                  "loss = loss * (self.accelerator.num_processes // self.get_tp_size())"),
        SFTTrainer.__init__: ("self.chat_template = get_training_chat_template(processing_class)",),
        Trainer.training_step: ("loss_is_scaled_for_ga = self.loss_is_scaled_for_ga",
                                "self.model_accepts_loss_kwargs and num_items_in_batch is not None",
                                ") or self.compute_loss_func is not None",
                                "loss = loss / self.current_gradient_accumulation_steps",
                                "self.accelerator.backward(loss, **kwargs)"),
        accelerate.Accelerator.backward: ("loss = loss / self.gradient_accumulation_steps",
                                          "self.scaler.scale(loss).backward(**kwargs)"),
    }
    for function, texts in mirrored.items():
        source = inspect.getsource(function)
        for text in texts:
            assert text in source, (function.__qualname__, text)
