"""Qwen3-MoE family (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention, a top-k router and
routed experts in place of the MLP (dense MLPs only in `mlp_only_layers`), no shared expert."""

from __future__ import annotations

from typing import Any

from parallel.convert.llama import GLOBAL_RULES
from parallel.convert.qwen3 import LAYER_RULES as QWEN3_LAYER_RULES
from parallel.convert.qwen3 import attention_options
from parallel.convert.registry import ModelFamily, Rule

_EXPERT = "mlp.experts.{expert}."
_FC1 = Rule(
    "gate_up", (_EXPERT + "gate_proj.weight", _EXPERT + "up_proj.weight"), "moe_intermediate_size"
)
_FC2 = Rule("copy", (_EXPERT + "down_proj.weight",))

ROUTED_EXPERT_RULES = {
    "mlp.router.weight": Rule("copy", ("mlp.gate.weight",)),
    # megatron's SequentialMLP (local layers, no grouped-GEMM kernel)
    "mlp.experts.local_experts.{expert}.linear_fc1.weight": _FC1,
    "mlp.experts.local_experts.{expert}.linear_fc2.weight": _FC2,
    # Transformer Engine's grouped GEMM (TEGroupedMLP): one weight per local expert
    "mlp.experts.linear_fc1.weight{expert}": _FC1,
    "mlp.experts.linear_fc2.weight{expert}": _FC2,
}

LAYER_RULES = {**QWEN3_LAYER_RULES, **ROUTED_EXPERT_RULES}


def moe_layer_pattern(hf_config: Any) -> list[int]:
    """megatron's moe_layer_freq: 1 for a MoE layer, 0 for a dense MLP, as HF's decoder layer
    decides (`mlp_only_layers`, every `decoder_sparse_step`-th layer)."""
    dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    return [int(i not in dense and (i + 1) % step == 0) for i in range(hf_config.num_hidden_layers)]


def routed_expert_options(hf_config: Any) -> dict[str, Any]:
    """TransformerConfig's MoE architecture from config.json. HF routes with a softmax over all
    experts, then top-k, then (norm_topk_prob) renormalises the k weights: megatron's softmax
    over the top-k logits is that renormalised softmax; without renormalisation megatron takes
    the softmax first (moe_router_pre_softmax). The top-k choice is the same either way."""
    return {
        "num_moe_experts": hf_config.num_experts,
        "moe_ffn_hidden_size": hf_config.moe_intermediate_size,
        "moe_router_topk": hf_config.num_experts_per_tok,
        "moe_router_pre_softmax": not getattr(hf_config, "norm_topk_prob", False),
        "moe_layer_freq": moe_layer_pattern(hf_config),
        "moe_router_dtype": "fp32",  # HF's softmax is in fp32 whatever the model dtype
    }


def megatron_options(hf_config: Any) -> dict[str, Any]:
    return {**attention_options(hf_config), **routed_expert_options(hf_config)}


FAMILY = ModelFamily(
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    layer_rules=LAYER_RULES,
    global_rules=GLOBAL_RULES,
    megatron_options=megatron_options,
)
