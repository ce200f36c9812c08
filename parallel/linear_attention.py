"""Hybrid linear-attention models (Qwen3.5): megatron-core's Gated DeltaNet layers among its
full-attention layers.

    linear_attention_fields(architecture, transformer_impl) -> TransformerConfig fields this
                                                               machine needs
    hybrid_block_spec(config, backends, vp_stage) -> TransformerBlockSubmodules of this rank
    check_linear_attention(hf_config, tp, pack_sequences) -> ModelConfigError / ParallelLayoutError

The family (`parallel/convert/qwen3_5.py`) declares the architecture: `experimental_attention_
variant="gated_delta_net"` and `linear_attention_freq`, the per-layer pattern (1 = DeltaNet).
megatron-core builds such a block only with Transformer Engine
(`get_transformer_block_with_experimental_attention_variant_spec`); with megatron's local
layers the block is assembled here the same way: each layer's local spec (a dense MLP or the
MoE layer, as `moe_layer_freq` says), its self-attention swapped for a `GatedDeltaNet`
(column-parallel in_proj, the local RMSNorm as its gated output norm, row-parallel out_proj) in
the DeltaNet layers; the input norm stays a layer norm of its own (TE fuses it into in_proj).

The DeltaNet's chunked kernel and its L2 norm come from flash-linear-attention (`fla`), which is
Triton: where it does not import (CPU, or a GPU node without it: with a warning, it is much
slower) megatron-core's own pure-torch chunked delta rule runs (its `deterministic_mode` path)
with `parallel.cpu_compat`'s L2 norm; with Transformer Engine's layers, whose attention refuses
that mode, the build stops and says to install `fla`.
"""

from __future__ import annotations

import copy
import functools
import importlib
import warnings
from typing import Any

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from parallel.cpu_compat import gated_delta_net_without_fla
from parallel.mesh import ParallelLayoutError
from parallel.model_backends import Backends, ModelConfigError


@functools.cache
def fla_importable() -> bool:
    try:
        importlib.import_module("fla.ops.gated_delta_rule")
    except Exception:  # noqa: BLE001 - a Triton without this machine's backend raises anything
        return False
    return True


def linear_attention_fields(architecture: dict[str, Any], transformer_impl: str) -> dict[str, Any]:
    """Extra TransformerConfig fields for a hybrid model on this machine: none with `fla`;
    without it, megatron-core's pure-torch delta rule (`deterministic_mode`), on CPU as the only
    way, on a GPU with a warning (slow); TE's attention refuses to run in that mode, so TE layers
    without `fla` are an error naming the fix."""
    if architecture.get("experimental_attention_variant") != "gated_delta_net":
        return {}
    if fla_importable():
        return {}
    install = "pip install flash-linear-attention"
    if transformer_impl == "transformer_engine":
        raise ModelConfigError(
            "this model's Gated DeltaNet layers need flash-linear-attention with Transformer "
            f"Engine's layers: {install}, or set model.transformer_impl=local"
        )
    if torch.cuda.is_available():
        warnings.warn(
            "flash-linear-attention is not installed: the Gated DeltaNet layers run megatron-"
            f"core's pure-torch delta rule, much slower than its kernels ({install})",
            stacklevel=2,
        )
    gated_delta_net_without_fla()
    return {"deterministic_mode": True}


def check_linear_attention(hf_config: Any, tp: int, pack_sequences: bool) -> None:
    """The layouts and settings megatron-core's Gated DeltaNet cannot take, named."""
    if "linear_attention" not in (getattr(hf_config, "layer_types", None) or []):
        return
    for key in ("linear_num_key_heads", "linear_num_value_heads"):
        heads = getattr(hf_config, key)
        if heads % tp:
            raise ParallelLayoutError(
                f"parallel.tp={tp} must divide the model's {heads} linear-attention heads "
                f"(config.json {key})"
            )
    if pack_sequences:
        raise ModelConfigError(
            "pack_sequences=true (actor.* / critic.*) cannot serve this model's Gated DeltaNet "
            "layers: megatron-core's DeltaNet has no packed-sequence path in this release; set "
            "pack_sequences=false"
        )


def _delta_net_attention(norm: Any) -> ModuleSpec:
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules

    return ModuleSpec(
        module=GatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear, out_norm=norm, out_proj=RowParallelLinear
        ),
    )


def hybrid_block_spec(
    config: TransformerConfig, backends: Backends, vp_stage: int | None = None
) -> TransformerBlockSubmodules:
    """This rank's layers of a hybrid model (module docstring); `backends.attention` "sdpa"
    puts `parallel.attention.SDPAttention` into the full-attention layers."""
    if backends.transformer_impl == "transformer_engine":
        from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
            get_transformer_block_with_experimental_attention_variant_spec,
        )

        return get_transformer_block_with_experimental_attention_variant_spec(config, vp_stage)
    from parallel.attention import SDPAttention

    # every layer's local spec, dense or MoE as config.moe_layer_freq says (one shared spec
    # object per kind: copied before its attention is swapped); megatron-core 0.19 refuses a
    # config with an attention variant there, so it is asked for the standard layers
    standard = copy.copy(config)
    standard.experimental_attention_variant = None
    layers = get_gpt_decoder_layer_specs(standard, False, normalization=config.normalization)
    norm = layers[0].submodules.input_layernorm
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    built = []
    for index in range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage)):
        layer = copy.deepcopy(layers[index])
        if config.linear_attention_freq[index]:
            layer.submodules.self_attention = _delta_net_attention(norm)
        elif backends.attention == "sdpa":
            layer.submodules.self_attention.submodules.core_attention = SDPAttention
        built.append(layer)
    return TransformerBlockSubmodules(layer_specs=built, layer_norm=norm)
