"""parallel.convert name rules and fused-layout splitting, on hand-worked tiny tensors.

Geometry: 4 query heads, 2 KV groups, head_dim 1 (hidden 4), ffn 4, vocab 5.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config

from parallel.convert import get_family, hf_rule, megatron_to_hf


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
    with pytest.raises(ValueError, match="supported: llama, qwen2"):
        get_family("mistral")
