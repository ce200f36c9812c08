"""Qwen2.5-VL: a Qwen2 language model behind a vision tower.

The checkpoint keeps the released layout (transformers writes it so too): the language model under
Qwen2's own names (`model.layers.*`, `model.embed_tokens`, `model.norm`, `lm_head`), so it maps
as Qwen2's does; the vision tower and its merger (`visual.*`) stay transformers' own module
(`parallel.vision_language`), held whole on the first pipeline stage of every TP rank, so their
tensors copy across by name. Multimodal RoPE: megatron-core's `mrope` with config.json's
`mrope_section` (transformers' default when absent).
"""

from __future__ import annotations

from typing import Any

from parallel.convert.llama import GLOBAL_RULES
from parallel.convert.qwen2 import LAYER_RULES
from parallel.convert.qwen2 import megatron_options as qwen2_options
from parallel.convert.registry import ModelFamily

# transformers' Qwen2.5-VL text rotary embedding reads this when config.json has none
DEFAULT_MROPE_SECTION = (16, 24, 24)


def mrope_section(text_config: Any) -> list[int]:
    rope = getattr(text_config, "rope_parameters", None) or {}
    return list(rope.get("mrope_section") or DEFAULT_MROPE_SECTION)


def megatron_options(text_config: Any) -> dict[str, Any]:
    return {**qwen2_options(text_config), "mrope_section": mrope_section(text_config)}


FAMILY = ModelFamily(
    name="qwen2_5_vl",
    # the checkpoint's type, and its language model's (the chunks carry the latter's config)
    model_types=("qwen2_5_vl", "qwen2_5_vl_text"),
    layer_rules=LAYER_RULES,
    global_rules=GLOBAL_RULES,
    megatron_options=megatron_options,
    module_prefixes={"visual.": "visual."},
    vision_tower="Qwen2_5_VisionTransformerPretrainedModel",
)
