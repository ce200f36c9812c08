"""Qwen3.5's name rules and layouts (parallel/convert/qwen3_5.py), on hand-worked tiny tensors.

Geometry: 4 query heads in 2 KV groups, head_dim 1 (hidden 4); Gated DeltaNet with 2 key heads
and 4 value heads of dim 1, conv kernel 2. Megatron -> HF is checked against hand-written
layouts; HF -> Megatron shards (any TP rank) against the same layouts.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3_5TextConfig

from parallel.convert import hf_rule, megatron_to_hf
from parallel.convert.mapping import _Geometry, _shard_from_hf, stored_shifted
from parallel.convert.qwen3_5 import linear_attention_pattern, megatron_options
from parallel.model_shapes import ModelShape
from tests.parallel.test_convert_mapping import _rows

LAYER_TYPES = ["linear_attention", "full_attention"]


def _config(**overrides) -> Qwen3_5TextConfig:
    options = dict(
        hidden_size=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=1,
        intermediate_size=4,
        vocab_size=5,
        num_hidden_layers=2,
        layer_types=LAYER_TYPES,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=1,
        linear_value_head_dim=1,
        linear_conv_kernel_dim=2,
    )
    return Qwen3_5TextConfig(**{**options, **overrides})


def _shards(
    config, global_name: str, hf: dict[str, torch.Tensor], tp: int, dim: int | None = 0
) -> torch.Tensor:
    """The TP shards built from `hf`, concatenated in rank order (the TP-gathered tensor);
    `dim=None`: a replicated parameter, read whole."""
    rule, _ = hf_rule(config, global_name)

    def read(name, dim, start, stop):
        return hf[name] if dim is None else hf[name].narrow(dim, start, stop - start)

    geo = _Geometry.from_hf(config, tp)
    like = torch.empty(0)
    shards = [
        _shard_from_hf(read, rule, geo, rank, dim, like, 0, (tp, rank), config)
        for rank in range(tp)
    ]
    return torch.cat(shards)


def test_gated_qkv_holds_each_groups_queries_then_their_gates():
    # HF q_proj: each head's query row, then its gate row: [q0 g0 q1 g1 q2 g2 q3 g3].
    # Megatron: group 0 = [q0 q1 g0 g1 k0 v0], group 1 = [q2 q3 g2 g3 k1 v1].
    full = _rows(10, 11, 50, 51, 20, 30, 12, 13, 52, 53, 21, 31)
    name = "decoder.layers.1.self_attention.linear_qkv.weight"
    out = dict(megatron_to_hf(_config(), 2, name, full))
    prefix = "model.layers.1.self_attn."
    assert torch.equal(out[prefix + "q_proj.weight"], _rows(10, 50, 11, 51, 12, 52, 13, 53))
    assert torch.equal(out[prefix + "k_proj.weight"], _rows(20, 21))
    assert torch.equal(out[prefix + "v_proj.weight"], _rows(30, 31))
    for tp in (1, 2):
        assert torch.equal(_shards(_config(), name, out, tp), full)


def test_delta_net_in_proj_is_split_over_tp_part_by_part():
    # HF: in_proj_qkv = [q0 q1 | k0 k1 | v0 v1 v2 v3], z = [z0..z3], b = [b0..b3], a = [a0..a3].
    config = _config()
    prefix = "model.layers.0.linear_attn."
    hf = {
        prefix + "in_proj_qkv.weight": _rows(10, 11, 20, 21, 30, 31, 32, 33),
        prefix + "in_proj_z.weight": _rows(40, 41, 42, 43),
        prefix + "in_proj_b.weight": _rows(50, 51, 52, 53),
        prefix + "in_proj_a.weight": _rows(60, 61, 62, 63),
    }
    # TP2 shard r: [q_r, k_r, v (2 rows), z (2), b (2), a (2)]
    tp2 = _rows(10, 20, 30, 31, 40, 41, 50, 51, 60, 61, 11, 21, 32, 33, 42, 43, 52, 53, 62, 63)
    name = "decoder.layers.0.self_attention.in_proj.weight"
    assert torch.equal(_shards(config, name, hf, 2), tp2)
    assert torch.equal(_shards(config, name, hf, 1), torch.cat(list(hf.values())))
    out = dict(megatron_to_hf(config, 2, name, tp2))
    assert out.keys() == hf.keys()
    assert all(torch.equal(out[key], hf[key]) for key in hf)


def test_qwen3_next_groups_its_projections_by_key_head():
    # HF in_proj_qkvz per key head g: [q_g, k_g, its 2 value heads' v, their z];
    # in_proj_ba per key head: [their b, their a]. Megatron's shards are Qwen3.5's above.
    from transformers import Qwen3NextConfig

    config = Qwen3NextConfig(**{**_config().to_dict(), "model_type": "qwen3_next"})
    prefix = "model.layers.0.linear_attn."
    hf = {
        prefix + "in_proj_qkvz.weight": _rows(10, 20, 30, 31, 40, 41, 11, 21, 32, 33, 42, 43),
        prefix + "in_proj_ba.weight": _rows(50, 51, 60, 61, 52, 53, 62, 63),
    }
    tp2 = _rows(10, 20, 30, 31, 40, 41, 50, 51, 60, 61, 11, 21, 32, 33, 42, 43, 52, 53, 62, 63)
    tp1 = _rows(10, 11, 20, 21, 30, 31, 32, 33, 40, 41, 42, 43, 50, 51, 52, 53, 60, 61, 62, 63)
    name = "decoder.layers.0.self_attention.in_proj.weight"
    assert torch.equal(_shards(config, name, hf, 2), tp2)
    assert torch.equal(_shards(config, name, hf, 1), tp1)
    for tp, full in ((1, tp1), (2, tp2)):
        out = dict(megatron_to_hf(config, tp, name, full))
        assert out.keys() == hf.keys() and all(torch.equal(out[k], hf[k]) for k in hf)


def test_delta_net_conv_runs_over_q_k_v_channels_split_part_by_part():
    config = _config()
    hf_name = "model.layers.0.linear_attn.conv1d.weight"
    weight = torch.arange(16.0).reshape(8, 1, 2)  # channels [q0 q1 k0 k1 v0 v1 v2 v3]
    name = "decoder.layers.0.self_attention.conv1d.weight"
    tp2 = _shards(config, name, {hf_name: weight}, 2)
    assert tp2[:, 0, 0].tolist() == [0, 4, 8, 10, 2, 6, 12, 14]  # [q0 k0 v0 v1 | q1 k1 v2 v3]
    assert torch.equal(dict(megatron_to_hf(config, 2, name, tp2))[hf_name], weight)


def test_zero_centred_norms_are_held_as_one_plus_w():
    config = _config()
    weight = torch.tensor([-0.5, 0.0, 0.25, 1.0])
    names = {
        "decoder.layers.0.input_layernorm.weight": "model.layers.0.input_layernorm.weight",
        "decoder.layers.1.self_attention.q_layernorm.weight": "model.layers.1.self_attn.q_norm.weight",
        "decoder.final_layernorm.weight": "model.norm.weight",
    }
    for megatron_name, hf_name in names.items():
        assert torch.equal(
            _shards(config, megatron_name, {hf_name: weight}, 1, dim=None), weight + 1
        )
        assert torch.equal(
            dict(megatron_to_hf(config, 2, megatron_name, weight + 1))[hf_name], weight
        )
        assert stored_shifted(config, hf_name)
    # the DeltaNet's gated output norm scales by its weight itself
    out_norm = "decoder.layers.0.self_attention.out_norm.weight"
    assert torch.equal(
        _shards(config, out_norm, {"model.layers.0.linear_attn.norm.weight": weight}, 1, None),
        weight,
    )
    assert not stored_shifted(config, "model.layers.0.linear_attn.norm.weight")


def test_layer_pattern_and_refused_variants():
    assert linear_attention_pattern(_config()) == [1, 0]
    options = megatron_options(_config())
    assert options["attention_output_gate"] and options["qk_layernorm"]
    assert options["linear_attention_freq"] == [1, 0]
    with pytest.raises(ValueError, match="sliding_attention"):
        linear_attention_pattern(_config(layer_types=["linear_attention", "sliding_attention"]))
    with pytest.raises(ValueError, match="attention_bias"):
        megatron_options(_config(attention_bias=True))


def test_plan_counts_the_delta_net_and_the_gate():
    shape = ModelShape.from_hf_config(_config().to_dict())
    assert shape.is_linear_layer(0) and not shape.is_linear_layer(1)
    # DeltaNet: in_proj 4 x (2 + 2 + 4 + 4 + 4 + 4), conv 8 x 2, A_log + dt_bias 8, out_norm 1,
    # out_proj 4 x 4, two layer norms 8
    assert shape.linear.params(4, 1) == 80 + 16 + 8 + 1 + 16
    # gated attention: q + gates + k + v = 4 + 4 + 2 + 2 rows of 4, o_proj 16, norms 8 + QK 2
    from parallel.model_shapes import attention_params

    assert attention_params(shape, 1, layer=1) == 48 + 16 + 8 + 2
    assert attention_params(shape, 1, layer=0) == 8 + 121
