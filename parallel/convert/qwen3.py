"""Qwen3 dense family: Llama's layout plus RMSNorm on each query and key head (QK-norm)."""

from __future__ import annotations

from typing import Any

from parallel.convert.llama import GLOBAL_RULES
from parallel.convert.llama import LAYER_RULES as LLAMA_LAYER_RULES
from parallel.convert.registry import ModelFamily, Rule

# megatron's q_layernorm / k_layernorm normalise each head_dim vector, as HF's q_norm / k_norm.
QK_NORM_RULES = {
    "self_attention.q_layernorm.weight": Rule("copy", ("self_attn.q_norm.weight",)),
    "self_attention.k_layernorm.weight": Rule("copy", ("self_attn.k_norm.weight",)),
}

LAYER_RULES = {**LLAMA_LAYER_RULES, **QK_NORM_RULES}


def attention_options(hf_config: Any) -> dict[str, Any]:
    """Qwen3's attention (dense and MoE): QK-norm, no biases, full attention in every layer."""
    if getattr(hf_config, "attention_bias", False):
        raise ValueError(f"{hf_config.model_type} with attention_bias=true is not supported")
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError(
            f"{hf_config.model_type} with use_sliding_window=true (config.json) is not supported"
        )
    return {"add_qkv_bias": False, "qk_layernorm": True}


FAMILY = ModelFamily(
    name="qwen3",
    model_types=("qwen3",),
    layer_rules=LAYER_RULES,
    global_rules=GLOBAL_RULES,
    megatron_options=attention_options,
)
