"""Llama family (Llama 2 / 3 / 3.1 / 3.2 and look-alikes): HF <-> Megatron name rules."""

from __future__ import annotations

from typing import Any

from parallel.convert.registry import ModelFamily, Rule

LAYER_RULES = {
    # local spec                                  HF suffix in model.layers.{i}.
    "input_layernorm.weight": Rule("copy", ("input_layernorm.weight",)),
    "pre_mlp_layernorm.weight": Rule("copy", ("post_attention_layernorm.weight",)),
    # Transformer Engine spec: norms fused into the next linear
    "self_attention.linear_qkv.layer_norm_weight": Rule("copy", ("input_layernorm.weight",)),
    "mlp.linear_fc1.layer_norm_weight": Rule("copy", ("post_attention_layernorm.weight",)),
    # both specs
    "self_attention.linear_qkv.weight": Rule(
        "qkv", ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
    ),
    "self_attention.linear_proj.weight": Rule("copy", ("self_attn.o_proj.weight",)),
    "mlp.linear_fc1.weight": Rule("gate_up", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    "mlp.linear_fc2.weight": Rule("copy", ("mlp.down_proj.weight",)),
}

GLOBAL_RULES = {
    "embedding.word_embeddings.weight": Rule("vocab", ("model.embed_tokens.weight",)),
    "decoder.final_layernorm.weight": Rule("copy", ("model.norm.weight",)),
    "output_layer.weight": Rule("vocab", ("lm_head.weight",)),
}


def megatron_options(hf_config: Any) -> dict[str, Any]:
    # Megatron has a switch for QKV bias only; HF Llama's attention_bias also biases o_proj.
    for flag in ("attention_bias", "mlp_bias"):
        if getattr(hf_config, flag, False):
            raise ValueError(f"Llama with {flag}=true (config.json) is not supported")
    return {"add_qkv_bias": False}


FAMILY = ModelFamily(
    name="llama",
    model_types=("llama",),
    layer_rules=LAYER_RULES,
    global_rules=GLOBAL_RULES,
    megatron_options=megatron_options,
)
