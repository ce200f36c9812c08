"""Qwen3-Next family (`qwen3_next`, Qwen3-Next-80B-A3B): the hybrid of Gated DeltaNet and gated
attention that Qwen3.5 took over (`qwen3_5.py`), with routed experts and a gated shared expert
(`qwen3_5_moe.py`). What differs is how HF stores the DeltaNet's projections: in_proj_qkvz and
in_proj_ba, grouped by key head (`grouped_in_proj`, `parallel.convert.delta_net_layout`); the
router renormalises its top-k weights as config.json's norm_topk_prob says, and
`mlp_only_layers` / `decoder_sparse_step` may leave some layers a dense MLP."""

from __future__ import annotations

from typing import Any

from parallel.convert.qwen2_moe import SHARED_EXPERT_RULES, shared_expert_options
from parallel.convert.qwen3_5 import DENSE_MLP_RULES, GLOBAL_RULES, HYBRID_RULES, hybrid_options
from parallel.convert.qwen3_moe import ROUTED_EXPERT_RULES, routed_expert_options
from parallel.convert.registry import ModelFamily, Rule

_IN_PROJ = Rule(
    "grouped_in_proj", ("linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight")
)
LAYER_RULES = {
    **HYBRID_RULES,
    "self_attention.in_proj.weight": _IN_PROJ,
    **ROUTED_EXPERT_RULES,
    **SHARED_EXPERT_RULES,
    **DENSE_MLP_RULES,
}


def megatron_options(hf_config: Any) -> dict[str, Any]:
    return {
        **hybrid_options(hf_config),
        **routed_expert_options(hf_config),
        **shared_expert_options(hf_config),
    }


FAMILY = ModelFamily(
    name="qwen3_next",
    model_types=("qwen3_next",),
    layer_rules=LAYER_RULES,
    global_rules=GLOBAL_RULES,
    megatron_options=megatron_options,
)
