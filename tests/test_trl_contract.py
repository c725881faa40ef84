"""Contract with TRL's private hooks that TreeGRPOTrainer overrides or relies on (trl>=1.16,<1.17)."""

import inspect

import trl
from trl import GRPOConfig, GRPOTrainer
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
