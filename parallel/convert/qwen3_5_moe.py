"""Qwen3.5-MoE text family (`qwen3_5_moe_text`): Qwen3.5's hybrid layers (Gated DeltaNet and
gated attention, `qwen3_5.py`) with a mixture of experts in every layer: a top-k router whose
k weights are always renormalised, routed experts, and a shared expert scaled by a sigmoid gate
(Qwen2-MoE's, `qwen2_moe.py`)."""

from __future__ import annotations

from typing import Any

from parallel.convert.qwen2_moe import SHARED_EXPERT_RULES, shared_expert_options
from parallel.convert.qwen3_5 import GLOBAL_RULES, HYBRID_RULES, hybrid_options
from parallel.convert.qwen3_moe import ROUTED_EXPERT_RULES, routed_expert_options
from parallel.convert.registry import ModelFamily

LAYER_RULES = {**HYBRID_RULES, **ROUTED_EXPERT_RULES, **SHARED_EXPERT_RULES}


def megatron_options(hf_config: Any) -> dict[str, Any]:
    # Qwen3.5-MoE's router renormalises its top-k weights unconditionally (config.json has no
    # norm_topk_prob): megatron's softmax over the top-k logits
    experts = {**routed_expert_options(hf_config), "moe_router_pre_softmax": False}
    return {**hybrid_options(hf_config), **experts, **shared_expert_options(hf_config)}


FAMILY = ModelFamily(
    name="qwen3_5_moe",
    model_types=("qwen3_5_moe_text",),
    layer_rules=LAYER_RULES,
    global_rules=GLOBAL_RULES,
    megatron_options=megatron_options,
)
