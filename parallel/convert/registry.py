"""Model families: HF `model_type` -> the name rules that map its weights to megatron-core's GPTModel.

A family is one small module in `parallel/convert/` that defines `FAMILY = ModelFamily(...)`;
the registry discovers every such module, so adding a family is adding one file.

Rule kinds (how one Megatron tensor relates to HF tensors; see `parallel.convert.mapping`):
    "copy"     one HF tensor, same layout (TP split, if any, along the param's partition_dim)
    "qkv"      HF (q, k, v) fused into Megatron's linear_qkv, interleaved per query group
    "gate_up"  HF (gate, up) fused into linear_fc1; each TP shard holds [gate_r; up_r]
    "vocab"    HF vocab rows, padded with zero rows up to the padded vocab size
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple


class Rule(NamedTuple):
    kind: str  # "copy" | "qkv" | "gate_up" | "vocab"
    hf_names: tuple[str, ...]


@dataclass(frozen=True)
class ModelFamily:
    """Weight-name rules and config checks for one HF architecture family.

    layer_rules: Megatron name suffix inside `decoder.layers.{i}.` -> Rule with HF suffixes
        inside `hf_layer_prefix`. Both local-spec and Transformer-Engine-spec names are listed
        (TE fuses the norms into the following linear as `layer_norm_weight`).
    global_rules: Megatron full name -> Rule with full HF names (embeddings, final norm, head).
    megatron_options: hf_config -> extra TransformerConfig kwargs (e.g. add_qkv_bias); raises
        ValueError for variants of the family that are not supported.
    """

    name: str
    model_types: tuple[str, ...]
    layer_rules: dict[str, Rule]
    global_rules: dict[str, Rule]
    megatron_options: Callable[[Any], dict[str, Any]]
    hf_layer_prefix: str = "model.layers.{layer}."
    notes: str = field(default="", compare=False)


_FAMILIES: dict[str, ModelFamily] | None = None


def _discover() -> dict[str, ModelFamily]:
    # Family modules import this one (for ModelFamily / Rule); finding them by file keeps the
    # registry from importing its own package back.
    families: dict[str, ModelFamily] = {}
    for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
        module = importlib.import_module(f"{__package__}.{info.name}")
        family = getattr(module, "FAMILY", None)
        if isinstance(family, ModelFamily):
            for model_type in family.model_types:
                families[model_type] = family
    return families


def supported_model_types() -> list[str]:
    global _FAMILIES
    if _FAMILIES is None:
        _FAMILIES = _discover()
    return sorted(_FAMILIES)


def get_family(model_type: str) -> ModelFamily:
    """The family for an HF `config.model_type`; ValueError naming the supported ones otherwise."""
    supported = supported_model_types()
    if model_type not in supported:
        raise ValueError(
            f"unsupported HF model_type {model_type!r} (config.json 'model_type'); "
            f"supported: {', '.join(supported)}. Add a family file in parallel/convert/."
        )
    return _FAMILIES[model_type]
