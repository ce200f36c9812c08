"""Model families: HF `model_type` -> the name rules that map its weights to megatron-core's GPTModel.

A family is one small module in `parallel/convert/` that defines `FAMILY = ModelFamily(...)`;
the registry discovers every such module, so adding a family is adding one file.

Rule kinds (how one Megatron tensor relates to HF tensors; see `parallel.convert.mapping`):
    "copy"     one HF tensor, same layout (TP split, if any, along the param's partition_dim)
    "qkv"      HF (q, k, v) fused into Megatron's linear_qkv, interleaved per query group
    "gate_up"  HF (gate, up) fused into linear_fc1; each TP shard holds [gate_r; up_r]; `ffn`
               names the config.json key of the width of gate and up (dense MLP, routed
               experts and shared experts differ)
    "vocab"    HF vocab rows, padded with zero rows up to the padded vocab size
    "gated_qkv"  like "qkv", with each query head's output gate (HF: beside its query in q_proj;
               Megatron: the group's gates after its queries)
    "plus_one" a zero-centred norm (HF computes x * (1 + w)): Megatron holds 1 + w
    "linear_in_proj", "grouped_in_proj", "linear_conv"  Gated DeltaNet's fused in_proj (HF
               in_proj_qkv, _z, _b, _a; Qwen3-Next's in_proj_qkvz, _ba grouped by key head) and
               its conv1d over q, k, v: split over TP part by part (`delta_net_layout`)

Routed experts: a rule whose Megatron name and HF names hold `{expert}` is one rule for every
expert (megatron's SequentialMLP `mlp.experts.local_experts.{expert}.`, Transformer Engine's
grouped GEMM `mlp.experts.linear_fc1.weight{expert}`); the index in global Megatron names and in
HF names is the global expert index. Expert weights are split by expert parallelism (whole
experts per EP rank) and by expert tensor parallelism instead of TP.
"""

from __future__ import annotations

import copy
import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from algorithms.registry import Registry


class Rule(NamedTuple):
    kind: str  # "copy" | "qkv" | "gated_qkv" | "gate_up" | "vocab" | "plus_one" | DeltaNet
    hf_names: tuple[str, ...]  # routed experts: with `{expert}` in a family's table
    ffn: str = "intermediate_size"  # gate_up only: the config.json key of gate's / up's width
    expert: bool = False  # a routed expert's weight; `mapping.hf_rule` sets it (names resolved)


@dataclass(frozen=True)
class ModelFamily:
    """Weight-name rules and config checks for one HF architecture family.

    layer_rules: Megatron name suffix inside `decoder.layers.{i}.` -> Rule with HF suffixes
        inside `hf_layer_prefix`. Both local-spec and Transformer-Engine-spec names are listed
        (TE fuses the norms into the following linear as `layer_norm_weight`).
    global_rules: Megatron full name -> Rule with full HF names (embeddings, final norm, head).
    megatron_options: hf_config (a multimodal checkpoint's: its text_config) -> extra
        TransformerConfig kwargs (e.g. add_qkv_bias,
        qk_layernorm, the MoE architecture: num_moe_experts, moe_router_topk, ...); raises
        ValueError for variants of the family that are not supported.
    """

    name: str
    model_types: tuple[str, ...]
    layer_rules: dict[str, Rule]
    global_rules: dict[str, Rule]
    megatron_options: Callable[[Any], dict[str, Any]]
    hf_layer_prefix: str = "model.layers.{layer}."
    # Modules rlcli keeps as transformers builds them (a vision tower): Megatron-side name
    # prefix -> HF prefix; their tensors copy across by name, whole on every rank that holds them.
    module_prefixes: dict[str, str] = field(default_factory=dict)
    # A vision-language family: the transformers class of its vision tower
    # (`parallel.vision_language`); its checkpoint's config.json holds text_config / vision_config.
    vision_tower: str | None = None
    notes: str = field(default="", compare=False)


_FAMILIES: Registry[ModelFamily] | None = None  # HF model_type -> family, found on first use


def _discover() -> Registry[ModelFamily]:
    # Family modules import this one (for ModelFamily / Rule); finding them by file keeps the
    # registry from importing its own package back.
    families: Registry[ModelFamily] = Registry(
        "model family",
        key="config.json model_type",
        alternatives=" (a new family is one file in parallel/convert/)",
    )
    for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
        module = importlib.import_module(f"{__package__}.{info.name}")
        family = getattr(module, "FAMILY", None)
        if isinstance(family, ModelFamily):
            for model_type in family.model_types:
                families[model_type] = family  # a model_type two families claim raises
    return families


def _families() -> Registry[ModelFamily]:
    global _FAMILIES
    if _FAMILIES is None:
        _FAMILIES = _discover()
    return _FAMILIES


def supported_model_types() -> list[str]:
    return _families().names()


def get_family(model_type: str) -> ModelFamily:
    """The family for an HF `config.model_type`; ValueError naming the supported ones otherwise."""
    return _families().lookup(model_type)


def language_model_type(config: dict[str, Any]) -> str | None:
    """The `model_type` of the text model inside a multimodal config.json (its `text_config`)
    when rlcli has a family for it and none for the outer type; None otherwise."""
    text = config.get("text_config")
    if not isinstance(text, dict) or config.get("model_type") in supported_model_types():
        return None
    model_type = text.get("model_type")
    return model_type if model_type in supported_model_types() else None


def multimodal_parts(hf_config: Any) -> tuple[Any, Any | None]:
    """(the language model's config, the multimodal config or None) of a checkpoint's config:
    a vision-language family's text_config and the whole, or a text model's config and None."""
    if get_family(hf_config.model_type).vision_tower is None:
        return hf_config, None
    if not hasattr(hf_config, "vision_config"):  # already its language model's config
        return hf_config, None
    text_config = copy.deepcopy(hf_config.text_config)
    # transformers keeps it on the whole model's config; the converter reads the language's
    text_config.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
    return text_config, hf_config
