"""Tree execution for transformers models: ``apply_tree_patches(model) -> PatchHandle``, a registry by model_type."""

from .checkpointing import (
    checkpointed_layers,
    keep_attention_outputs,
    keep_matmul_outputs,
    keep_matmul_outputs_within,
    keep_mixer_outputs,
    keep_mixer_outputs_within,
    matmul_output_bytes_per_token,
    mixer_output_bytes_per_token,
    store_layer_activations,
)
from .core import (
    PatchHandle,
    TreeFamily,
    apply_tree_patches,
    chunk_grid,
    cpu_safe,
    register_family,
    supported_model_types,
)

__all__ = ["PatchHandle", "TreeFamily", "apply_tree_patches", "checkpointed_layers", "chunk_grid", "cpu_safe",
           "keep_attention_outputs", "keep_matmul_outputs", "keep_matmul_outputs_within", "keep_mixer_outputs",
           "keep_mixer_outputs_within", "matmul_output_bytes_per_token", "mixer_output_bytes_per_token",
           "register_family", "store_layer_activations", "supported_model_types"]
