"""parallel.convert name rules and fused-layout splitting, on hand-worked tiny tensors.

Geometry: 4 query heads, 2 KV groups, head_dim 1 (hidden 4), ffn 4, vocab 5.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig

from parallel.convert import get_family, hf_rule, megatron_to_hf, supported_model_types
from parallel.convert.mapping import renumber_expert


def _config(**overrides) -> Qwen2Config:
    options = dict(
        hidden_size=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=4,
        vocab_size=5,
        num_hidden_layers=2,
    )
    return Qwen2Config(**{**options, **overrides})


def _rows(*values: float) -> torch.Tensor:
    """[len(values), 4] tensor whose row i is filled with values[i]."""
    return torch.tensor(values).unsqueeze(1).expand(-1, 4).clone()


def test_qkv_is_interleaved_per_query_group():
    # Megatron: group 0 = [q0, q1, k0, v0], group 1 = [q2, q3, k1, v1]
    full = _rows(10, 11, 20, 30, 12, 13, 21, 31)
    out = dict(
        megatron_to_hf(_config(), 2, "decoder.layers.1.self_attention.linear_qkv.weight", full)
    )
    prefix = "model.layers.1.self_attn."
    assert torch.equal(out[prefix + "q_proj.weight"], _rows(10, 11, 12, 13))
    assert torch.equal(out[prefix + "k_proj.weight"], _rows(20, 21))
    assert torch.equal(out[prefix + "v_proj.weight"], _rows(30, 31))
    bias = torch.tensor([10.0, 11, 20, 30, 12, 13, 21, 31])
    out = dict(
        megatron_to_hf(_config(), 2, "decoder.layers.0.self_attention.linear_qkv.bias", bias)
    )
    assert out["model.layers.0.self_attn.k_proj.bias"].tolist() == [20, 21]


def test_gate_up_tp_gathered_layout():
    # TP2 shards [gate rows 0-1; up rows 0-1] and [gate rows 2-3; up rows 2-3], concatenated
    full = _rows(0, 1, 100, 101, 2, 3, 102, 103)
    out = dict(megatron_to_hf(_config(), 2, "decoder.layers.0.mlp.linear_fc1.weight", full))
    assert torch.equal(out["model.layers.0.mlp.gate_proj.weight"], _rows(0, 1, 2, 3))
    assert torch.equal(out["model.layers.0.mlp.up_proj.weight"], _rows(100, 101, 102, 103))
    # the same tensor means something else at TP1: [gate; up]
    out = dict(megatron_to_hf(_config(), 1, "decoder.layers.0.mlp.linear_fc1.weight", full))
    assert torch.equal(out["model.layers.0.mlp.gate_proj.weight"], _rows(0, 1, 100, 101))


def test_vocab_padding_is_dropped():
    full = _rows(0, 1, 2, 3, 4, -1)  # 5 real rows padded to 6 for TP2
    ((name, tensor),) = megatron_to_hf(_config(), 2, "output_layer.weight", full)
    assert name == "lm_head.weight" and torch.equal(tensor, _rows(0, 1, 2, 3, 4))


def test_tied_output_layer_reads_embedding_and_is_not_exported():
    rule, skip_export = hf_rule(_config(tie_word_embeddings=True), "output_layer.weight")
    assert rule.hf_names == ("model.embed_tokens.weight",) and skip_export
    rule, skip_export = hf_rule(_config(), "output_layer.weight")
    assert rule.hf_names == ("lm_head.weight",) and not skip_export


def test_te_and_local_norm_names_map_to_the_same_hf_tensor():
    config = _config()
    te, _ = hf_rule(config, "decoder.layers.3.mlp.linear_fc1.layer_norm_weight")
    local, _ = hf_rule(config, "decoder.layers.3.pre_mlp_layernorm.weight")
    assert te.hf_names == local.hf_names == ("model.layers.3.post_attention_layernorm.weight",)


def test_unknown_names_and_model_types_are_explained():
    with pytest.raises(KeyError, match="parallel/convert/qwen2.py"):
        hf_rule(_config(), "decoder.layers.0.mlp.router.weight")
    names = ", ".join(supported_model_types())  # every family file's types, sorted
    assert {"llama", "qwen2", "qwen2_5_vl", "qwen3_5_text", "qwen3_next"} <= set(names.split(", "))
    with pytest.raises(ValueError, match=f"valid names: {names}"):
        get_family("mistral")


def _moe_config(config_cls=Qwen3MoeConfig, **overrides):
    # 4 experts of width 2 (gate rows 0-1, up rows 0-1), shared expert of width 4
    options = dict(
        hidden_size=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=1,
        intermediate_size=4,
        moe_intermediate_size=2,
        num_experts=4,
        num_experts_per_tok=2,
        vocab_size=5,
        num_hidden_layers=2,
    )
    if config_cls is Qwen2MoeConfig:
        options.pop("head_dim")
        options["shared_expert_intermediate_size"] = 4
    return config_cls(**{**options, **overrides})


def test_routed_expert_names_carry_the_global_expert_index():
    config = _moe_config()
    sequential, _ = hf_rule(
        config, "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"
    )
    grouped, _ = hf_rule(config, "decoder.layers.1.mlp.experts.linear_fc1.weight3")  # TE
    prefix = "model.layers.1.mlp.experts.3."
    assert (
        sequential.hf_names
        == grouped.hf_names
        == (
            prefix + "gate_proj.weight",
            prefix + "up_proj.weight",
        )
    )
    assert sequential.expert and grouped.expert
    down, _ = hf_rule(config, "decoder.layers.0.mlp.experts.linear_fc2.weight2")
    assert down.hf_names == ("model.layers.0.mlp.experts.2.down_proj.weight",) and down.expert
    router, _ = hf_rule(config, "decoder.layers.0.mlp.router.weight")
    assert router.hf_names == ("model.layers.0.mlp.gate.weight",) and not router.expert
    moved = renumber_expert("decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight", 2)
    assert moved == "decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight"
    with pytest.raises(ValueError, match="not a routed expert"):
        renumber_expert("decoder.layers.0.mlp.router.weight", 2)


def test_expert_gate_up_follows_expert_tp_not_tp():
    name = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"
    full = _rows(0, 1, 100, 101)  # expert TP 1: [gate; up], whatever the attention's TP
    out = dict(megatron_to_hf(_moe_config(), 2, name, full, etp=1))
    assert torch.equal(out["model.layers.0.mlp.experts.0.gate_proj.weight"], _rows(0, 1))
    assert torch.equal(out["model.layers.0.mlp.experts.0.up_proj.weight"], _rows(100, 101))
    out = dict(megatron_to_hf(_moe_config(), 2, name, full, etp=2))  # [gate_0; up_0; gate_1; ..]
    assert torch.equal(out["model.layers.0.mlp.experts.0.gate_proj.weight"], _rows(0, 100))


def test_shared_expert_uses_its_own_width_and_gate():
    config = _moe_config(Qwen2MoeConfig)
    full = _rows(0, 1, 10, 11, 2, 3, 12, 13)  # TP2, width 4: [gate 0-1; up 0-1; gate 2-3; up 2-3]
    out = dict(
        megatron_to_hf(config, 2, "decoder.layers.0.mlp.shared_experts.linear_fc1.weight", full)
    )
    assert torch.equal(out["model.layers.0.mlp.shared_expert.gate_proj.weight"], _rows(0, 1, 2, 3))
    gate, _ = hf_rule(config, "decoder.layers.0.mlp.shared_experts.gate_weight")
    assert gate.hf_names == ("model.layers.0.mlp.shared_expert_gate.weight",)


def test_qwen3_qk_norms_and_rejected_variants():
    config = Qwen3Config(hidden_size=4, num_attention_heads=4, num_key_value_heads=2, head_dim=2)
    q_norm, _ = hf_rule(config, "decoder.layers.0.self_attention.q_layernorm.weight")
    k_norm, _ = hf_rule(config, "decoder.layers.0.self_attention.k_layernorm.weight")
    assert q_norm.hf_names == ("model.layers.0.self_attn.q_norm.weight",)
    assert k_norm.hf_names == ("model.layers.0.self_attn.k_norm.weight",)
    family = get_family("qwen3")
    assert family.megatron_options(config) == {"add_qkv_bias": False, "qk_layernorm": True}
    with pytest.raises(ValueError, match="attention_bias"):
        family.megatron_options(Qwen3Config(attention_bias=True))


def test_moe_architecture_follows_config_json():
    options = get_family("qwen3_moe").megatron_options(_moe_config(norm_topk_prob=True))
    assert options["num_moe_experts"] == 4 and options["moe_router_topk"] == 2
    assert options["moe_router_pre_softmax"] is False  # renormalised top-k: softmax after top-k
    assert options["moe_layer_freq"] == [1, 1]
    config = _moe_config(Qwen2MoeConfig, mlp_only_layers=[0], norm_topk_prob=False)
    options = get_family("qwen2_moe").megatron_options(config)
    assert options["moe_router_pre_softmax"] is True and options["moe_layer_freq"] == [0, 1]
    assert options["moe_shared_expert_gate"] and options["moe_shared_expert_intermediate_size"] == 4
    assert options["add_qkv_bias"]
