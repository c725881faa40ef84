"""Plain full-attention families: tree attention plus depth positions is all they need."""

from __future__ import annotations

from .core import TreeFamily, register_family

register_family(TreeFamily(model_types=("llama",), attention_classes=("LlamaAttention",)))
register_family(TreeFamily(model_types=("qwen2",), attention_classes=("Qwen2Attention",)))
register_family(TreeFamily(model_types=("qwen3",), attention_classes=("Qwen3Attention",)))
register_family(TreeFamily(model_types=("qwen3_moe",), attention_classes=("Qwen3MoeAttention",), moe=True))
