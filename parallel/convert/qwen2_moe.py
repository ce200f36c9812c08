"""Qwen2-MoE family (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (QKV biases), routed
experts, and one shared expert whose output a sigmoid gate scales (megatron's SharedExpertMLP
with moe_shared_expert_gate)."""

from __future__ import annotations

from typing import Any

from parallel.convert.llama import GLOBAL_RULES
from parallel.convert.qwen2 import LAYER_RULES as QWEN2_LAYER_RULES
from parallel.convert.qwen3_moe import ROUTED_EXPERT_RULES, routed_expert_options
from parallel.convert.registry import ModelFamily, Rule

SHARED_EXPERT_RULES = {
    "mlp.shared_experts.linear_fc1.weight": Rule(
        "gate_up",
        ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"),
        "shared_expert_intermediate_size",
    ),
    "mlp.shared_experts.linear_fc2.weight": Rule("copy", ("mlp.shared_expert.down_proj.weight",)),
    "mlp.shared_experts.gate_weight": Rule("copy", ("mlp.shared_expert_gate.weight",)),
}

LAYER_RULES = {**QWEN2_LAYER_RULES, **ROUTED_EXPERT_RULES, **SHARED_EXPERT_RULES}


def shared_expert_options(hf_config: Any) -> dict[str, Any]:
    """megatron's SharedExpertMLP with its sigmoid gate, when config.json has a shared expert."""
    if not getattr(hf_config, "shared_expert_intermediate_size", 0):
        return {}
    return {
        "moe_shared_expert_intermediate_size": hf_config.shared_expert_intermediate_size,
        "moe_shared_expert_gate": True,
    }


def megatron_options(hf_config: Any) -> dict[str, Any]:
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError("Qwen2-MoE with use_sliding_window=true (config.json) is not supported")
    options = {"add_qkv_bias": bool(getattr(hf_config, "qkv_bias", True))}
    return {**options, **routed_expert_options(hf_config), **shared_expert_options(hf_config)}


FAMILY = ModelFamily(
    name="qwen2_moe",
    model_types=("qwen2_moe",),
    layer_rules=LAYER_RULES,
    global_rules=GLOBAL_RULES,
    megatron_options=megatron_options,
)
