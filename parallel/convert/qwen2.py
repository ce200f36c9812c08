"""Qwen2 / Qwen2.5 family: Llama's layout plus biases on q, k and v."""

from __future__ import annotations

from typing import Any

from parallel.convert.llama import GLOBAL_RULES
from parallel.convert.llama import LAYER_RULES as LLAMA_LAYER_RULES
from parallel.convert.registry import ModelFamily, Rule

LAYER_RULES = {
    **LLAMA_LAYER_RULES,
    "self_attention.linear_qkv.bias": Rule(
        "qkv", ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")
    ),
}


def megatron_options(hf_config: Any) -> dict[str, Any]:
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError("Qwen2 with use_sliding_window=true (config.json) is not supported")
    return {"add_qkv_bias": True}


FAMILY = ModelFamily(
    name="qwen2",
    model_types=("qwen2",),
    layer_rules=LAYER_RULES,
    global_rules=GLOBAL_RULES,
    megatron_options=megatron_options,
)
