"""Tree execution for transformers models: ``apply_tree_patches(model) -> PatchHandle``, a registry by model_type."""

from .core import PatchHandle, TreeFamily, apply_tree_patches, cpu_safe, register_family, supported_model_types

__all__ = ["PatchHandle", "TreeFamily", "apply_tree_patches", "cpu_safe", "register_family", "supported_model_types"]
