"""Qwen3.5 text family (`qwen3_5_text`, the language model of Qwen3.5 as Qwen3_5ForCausalLM
saves it): a hybrid of Gated DeltaNet linear-attention layers and gated full-attention layers
(`layer_types` in config.json), each followed by a dense gated MLP. Its mixture-of-experts
siblings (`qwen3_5_moe.py`, `qwen3_next.py`) share these rules (`HYBRID_RULES`,
`hybrid_options`).

Megatron side: megatron-core's own `GatedDeltaNet` (`experimental_attention_variant=
"gated_delta_net"`, `linear_attention_freq` the per-layer pattern) and its self-attention with
`attention_output_gate` (a sigmoid gate per query head); `parallel.linear_attention` builds the
layer specs.

Weights:
- Every RMSNorm but the DeltaNet's output norm is zero-centred in HF (`x * (1 + w)`, stored w);
  megatron's norms scale by the stored weight, so the rules `plus_one` store 1 + w. Norm weights
  are 1-D, which megatron's optimizer exempts from weight decay, so training the shifted weight is
  training the same function. The shift costs the round trip its last bits (w + 1 - 1 != w in
  floating point: about 1e-8 for |w| ~ 0.1 in fp32).
- q_proj holds each head's query and its output gate side by side ([q_0; g_0; q_1; g_1; ...]);
  megatron's linear_qkv holds per KV group its query heads, their gates, then k and v (`gated_qkv`).
- The DeltaNet's in_proj is HF's in_proj_qkv, in_proj_z, in_proj_b and in_proj_a one after the
  other; its conv1d runs over the q, k, v channels: both are split over TP part by part
  (`linear_in_proj`, `linear_conv`), so a TP rank holds whole key / value heads of each part.
"""

from __future__ import annotations

from typing import Any

from parallel.convert.llama import GLOBAL_RULES as LLAMA_GLOBAL_RULES
from parallel.convert.registry import ModelFamily, Rule

_NORM = "plus_one"
_LINEAR = "linear_attn."

HYBRID_RULES = {  # the layers' attention and norms; the MLP follows (dense here)
    # local spec                                  HF suffix in model.layers.{i}.
    "input_layernorm.weight": Rule(_NORM, ("input_layernorm.weight",)),
    "pre_mlp_layernorm.weight": Rule(_NORM, ("post_attention_layernorm.weight",)),
    # Transformer Engine spec: norms fused into the next linear
    "self_attention.linear_qkv.layer_norm_weight": Rule(_NORM, ("input_layernorm.weight",)),
    "self_attention.in_proj.layer_norm_weight": Rule(_NORM, ("input_layernorm.weight",)),
    "mlp.linear_fc1.layer_norm_weight": Rule(_NORM, ("post_attention_layernorm.weight",)),
    # gated full attention
    "self_attention.linear_qkv.weight": Rule(
        "gated_qkv",
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    ),
    "self_attention.q_layernorm.weight": Rule(_NORM, ("self_attn.q_norm.weight",)),
    "self_attention.k_layernorm.weight": Rule(_NORM, ("self_attn.k_norm.weight",)),
    "self_attention.linear_proj.weight": Rule("copy", ("self_attn.o_proj.weight",)),
    # Gated DeltaNet
    "self_attention.in_proj.weight": Rule(
        "linear_in_proj",
        tuple(_LINEAR + f"in_proj_{part}.weight" for part in ("qkv", "z", "b", "a")),
    ),
    "self_attention.conv1d.weight": Rule("linear_conv", (_LINEAR + "conv1d.weight",)),
    "self_attention.A_log": Rule("copy", (_LINEAR + "A_log",)),
    "self_attention.dt_bias": Rule("copy", (_LINEAR + "dt_bias",)),
    "self_attention.out_norm.weight": Rule("copy", (_LINEAR + "norm.weight",)),
    "self_attention.out_proj.weight": Rule("copy", (_LINEAR + "out_proj.weight",)),
}
DENSE_MLP_RULES = {
    "mlp.linear_fc1.weight": Rule("gate_up", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    "mlp.linear_fc2.weight": Rule("copy", ("mlp.down_proj.weight",)),
}
LAYER_RULES = {**HYBRID_RULES, **DENSE_MLP_RULES}

GLOBAL_RULES = {
    **LLAMA_GLOBAL_RULES,
    "decoder.final_layernorm.weight": Rule(_NORM, ("model.norm.weight",)),
}


def linear_attention_pattern(hf_config: Any) -> list[int]:
    """megatron's linear_attention_freq as a list: 1 for a Gated DeltaNet layer, 0 for full
    attention, from config.json's `layer_types`."""
    kinds = {"linear_attention": 1, "full_attention": 0}
    layer_types = list(hf_config.layer_types)
    unknown = sorted(set(layer_types) - set(kinds))
    if unknown:
        raise ValueError(
            f"{hf_config.model_type} layer_types {unknown} (config.json) are not supported: "
            f"only {sorted(kinds)}"
        )
    return [kinds[kind] for kind in layer_types]


def hybrid_options(hf_config: Any) -> dict[str, Any]:
    """Gated attention with QK-norm in the full-attention layers, Gated DeltaNet in the others."""
    if getattr(hf_config, "attention_bias", False):
        raise ValueError(f"{hf_config.model_type} with attention_bias=true is not supported")
    return {
        "add_qkv_bias": False,
        "qk_layernorm": True,
        "attention_output_gate": True,
        "experimental_attention_variant": "gated_delta_net",
        "linear_attention_freq": linear_attention_pattern(hf_config),
        "linear_conv_kernel_dim": hf_config.linear_conv_kernel_dim,
        "linear_key_head_dim": hf_config.linear_key_head_dim,
        "linear_value_head_dim": hf_config.linear_value_head_dim,
        "linear_num_key_heads": hf_config.linear_num_key_heads,
        "linear_num_value_heads": hf_config.linear_num_value_heads,
    }


megatron_options = hybrid_options

FAMILY = ModelFamily(
    name="qwen3_5",
    model_types=("qwen3_5_text",),
    layer_rules=LAYER_RULES,
    global_rules=GLOBAL_RULES,
    megatron_options=megatron_options,
)
