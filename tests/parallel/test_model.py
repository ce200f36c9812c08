"""parallel.model: HF config -> TransformerConfig, vocab padding, and user-facing errors.

(Forward parity with HF, critic values and pipeline/TP layouts: test_convert_parity.py.)
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config

from parallel.mesh import ParallelLayoutError
from parallel.model import padded_vocab_size, transformer_config_from_hf
from parallel.model_options import MoeOptions
from tests.parallel.dist_utils import TINY_CONFIG


def _qwen2(**overrides) -> Qwen2Config:
    options = {**TINY_CONFIG, **overrides}
    rope_theta = options.pop("rope_theta")
    return Qwen2Config(
        **options, rope_parameters={"rope_type": "default", "rope_theta": rope_theta}
    )


@pytest.mark.parametrize(
    "vocab, tp, padded", [(251, 1, 251), (251, 2, 252), (251, 4, 252), (151936, 8, 151936)]
)
def test_padded_vocab_is_next_multiple_of_tp(vocab, tp, padded):
    assert padded_vocab_size(vocab, tp) == padded


def test_qwen2_config_maps_architecture():
    config = transformer_config_from_hf(_qwen2(), tp=2, pp=2, dtype=torch.bfloat16)
    assert (config.num_layers, config.hidden_size, config.ffn_hidden_size) == (4, 64, 96)
    assert (config.num_attention_heads, config.num_query_groups, config.kv_channels) == (4, 2, 16)
    assert config.add_qkv_bias and not config.add_bias_linear and config.gated_linear_unit
    assert config.normalization == "RMSNorm" and config.layernorm_epsilon == 1e-6
    assert config.params_dtype == torch.bfloat16 and config.bf16
    assert config.tensor_model_parallel_size == 2 and config.pipeline_model_parallel_size == 2


def test_llama_has_no_qkv_bias_and_rejects_attention_bias():
    options = {**TINY_CONFIG}
    options.pop("rope_theta")
    assert not transformer_config_from_hf(LlamaConfig(**options), tp=1, pp=1).add_qkv_bias
    with pytest.raises(ValueError, match="attention_bias"):
        transformer_config_from_hf(LlamaConfig(**options, attention_bias=True), tp=1, pp=1)


def test_layout_errors_name_the_config_keys():
    with pytest.raises(ParallelLayoutError, match="num_key_value_heads"):
        transformer_config_from_hf(_qwen2(), tp=4, pp=1)
    with pytest.raises(ParallelLayoutError, match="num_hidden_layers"):
        transformer_config_from_hf(_qwen2(), tp=1, pp=3)
    with pytest.raises(ParallelLayoutError, match="parallel.vpp"):
        transformer_config_from_hf(_qwen2(), tp=1, pp=2, vpp=4)


def test_unsupported_rope_scaling_and_model_type():
    config = _qwen2()
    config.rope_parameters = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}
    with pytest.raises(ValueError, match="unsupported RoPE scaling"):
        transformer_config_from_hf(config, tp=1, pp=1)
    config.model_type = "gpt2"
    with pytest.raises(ValueError, match="valid names: llama, qwen2"):
        transformer_config_from_hf(config, tp=1, pp=1)


def _qwen3_moe(**overrides):
    from transformers import Qwen3MoeConfig

    from tests.parallel.dist_utils import FAMILY_CONFIG

    options = {**TINY_CONFIG, **FAMILY_CONFIG["qwen3_moe"], **overrides}
    options.pop("rope_theta")
    return Qwen3MoeConfig(**options)


def test_moe_config_carries_experts_layout_and_training_knobs():
    config = transformer_config_from_hf(
        _qwen3_moe(), tp=2, pp=1, ep=2, etp=1, moe=MoeOptions(aux_loss_coef=0.01)
    )
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size) == (
        8,
        2,
        32,
    )
    assert (config.expert_model_parallel_size, config.expert_tensor_parallel_size) == (2, 1)
    assert config.moe_aux_loss_coeff == 0.01 and config.moe_router_load_balancing_type == "aux_loss"
    assert config.moe_token_dispatcher_type == "alltoall" and not config.moe_grouped_gemm
    assert config.qk_layernorm and config.kv_channels == 32
    default = transformer_config_from_hf(_qwen3_moe(router_aux_loss_coef=0.002), tp=1, pp=1)
    assert default.moe_aux_loss_coeff == 0.002  # config.json's coefficient
    assert default.expert_tensor_parallel_size == 1  # expert TP defaults to TP
    off = transformer_config_from_hf(
        _qwen3_moe(), tp=1, pp=1, moe=MoeOptions(load_balancing="none")
    )
    assert off.moe_aux_loss_coeff == 0.0


def test_moe_layout_and_dense_model_errors_name_the_keys():
    from parallel.model import ModelConfigError

    with pytest.raises(ParallelLayoutError, match="parallel.ep=3 must divide the model's 8"):
        transformer_config_from_hf(_qwen3_moe(), tp=1, pp=1, ep=3)
    with pytest.raises(ParallelLayoutError, match="parallel.expert_tp=3"):
        transformer_config_from_hf(_qwen3_moe(), tp=1, pp=1, etp=3)
    with pytest.raises(ModelConfigError, match="parallel.ep"):
        transformer_config_from_hf(_qwen2(), tp=1, pp=1, ep=2)
    with pytest.raises(ModelConfigError, match="model.moe_"):
        transformer_config_from_hf(_qwen2(), tp=1, pp=1, moe=MoeOptions(aux_loss_coef=0.1))


class _Head(torch.nn.Linear):
    """The LM head's contract as GPTModel calls it: hidden [s, b, h] -> (logits, bias)."""

    sequence_parallel = False

    def forward(self, hidden, weight=None, runtime_gather_output=None):
        return super().forward(hidden), None


def test_batch_first_head_gives_the_same_logits_and_gradients_without_a_copy():
    from parallel.model import compute_logits_batch_first

    torch.manual_seed(0)
    plain, batch_first = _Head(8, 32), _Head(8, 32)
    batch_first.load_state_dict(plain.state_dict())
    compute_logits_batch_first(batch_first)
    assert list(batch_first.state_dict()) == list(plain.state_dict())
    hidden = torch.randn(5, 3, 8)  # [s, b, h]
    outputs = {}

    def keep_logits(module, args, output):
        outputs["logits"] = output[0]  # after the head's own hooks: its [s, b, V] view

    batch_first.register_forward_hook(keep_logits)

    expected = plain(hidden)[0].transpose(0, 1).contiguous()  # GPTModel's return
    got_sequence_first, _ = batch_first(hidden)
    got = got_sequence_first.transpose(0, 1).contiguous()
    assert got.shape == (3, 5, 32)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # GPTModel's `.contiguous()` hands back the head's own [b, s, V] tensor: nothing copied.
    assert not outputs["logits"].is_contiguous()
    assert got.data_ptr() == outputs["logits"].data_ptr()

    upstream = torch.randn(3, 5, 32)
    (expected * upstream).sum().backward()
    (got * upstream).sum().backward()
    torch.testing.assert_close(batch_first.weight.grad, plain.weight.grad)
    torch.testing.assert_close(batch_first.bias.grad, plain.bias.grad)

    # Sequence-parallel (megatron may set it per call): the head's own layout, untouched.
    batch_first.sequence_parallel = True
    torch.testing.assert_close(batch_first(hidden)[0], plain(hidden)[0], rtol=0, atol=0)
