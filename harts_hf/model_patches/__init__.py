"""Tree execution for transformers models: ``apply_tree_patches(model) -> PatchHandle``, a registry by model_type."""

from .core import PatchHandle, TreeFamily, apply_tree_patches, cpu_safe, register_family, supported_model_types
from .stored_layers import checkpointed_layers, store_layer_activations

__all__ = ["PatchHandle", "TreeFamily", "apply_tree_patches", "checkpointed_layers", "cpu_safe", "register_family",
           "store_layer_activations", "supported_model_types"]
