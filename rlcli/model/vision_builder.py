"""Build a small random Qwen2.5-VL and its processor locally (``model.spec.architecture:
qwen2_5_vl``), for the vision-language quickstart and tests.

The folder is what a downloaded Qwen2.5-VL checkpoint holds: ``config.json`` (``text_config`` and
``vision_config``), safetensors, a tokenizer with Qwen's vision tokens, a chat template that
writes an image part as ``<|vision_start|><|image_pad|><|vision_end|>``, and the image
processor's ``preprocessor_config.json`` (``min_pixels`` / ``max_pixels``), so transformers'
``AutoProcessor`` and vLLM load it as they load the released ones. The language model takes the
sizes of ``model.spec``; the vision tower is the smallest that keeps Qwen2.5-VL's structure
(windowed and full-attention blocks, a 2 x 2 patch merger).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from rlcli.config.model import ModelBuildConfig
from rlcli.model import chat_template as chatml

# Qwen2-VL's tokens around an image (one <|image_pad|> a merged 2 x 2 block of patches).
VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD = (
    "<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>",
)  # fmt: skip
PATCH = 14  # pixels a patch side; a merged block is 28 x 28 pixels
MIN_PIXELS, MAX_PIXELS = 28 * 28, 56 * 56  # one to four merged blocks an image

# ChatML (``rlcli.model.chat_template``, without tools) whose contents may be lists of parts, an
# image part written as Qwen2-VL's template writes it.
CHATML_WITH_IMAGES = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}"
    "{%- else %}{%- for part in message.content %}"
    "{%- if part.type == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part.type == 'text' %}{{- part.text }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_processor(corpus: list[str], vocab_size: int):
    """Qwen2.5-VL's processor around a BPE tokenizer trained on ``corpus`` (ChatML, EOS
    ``<|im_end|>``) with the vision tokens added."""
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    from rlcli.model.builder import train_tokenizer

    tokenizer = train_tokenizer(corpus, vocab_size, "chatml")
    tokenizer.add_special_tokens(
        {
            "additional_special_tokens": [
                chatml.IM_START, chatml.IM_END, VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD,
            ]
        }
    )  # fmt: skip
    tokenizer.chat_template = CHATML_WITH_IMAGES
    return Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(),
        chat_template=CHATML_WITH_IMAGES,
    )


def mrope_section(head_dim: int) -> list[int]:
    """Multimodal RoPE sections (temporal, height, width) over half of ``head_dim``, in the
    ratio of Qwen2.5-VL's [16, 24, 24] for its 128."""
    half = head_dim // 2
    temporal = half // 4
    height = (half - temporal) // 2
    return [temporal, height, half - temporal - height]


def _vision_settings(spec: ModelBuildConfig) -> dict:
    return dict(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
        out_hidden_size=spec.hidden_size, fullatt_block_indexes=[1],
    )  # fmt: skip


def vision_shape(spec: ModelBuildConfig):
    """What ``rlcli plan`` counts of the tower this builder makes."""
    from parallel.vision_shape import VisionShape

    return VisionShape.from_vision_config(_vision_settings(spec), spec.hidden_size)


def build_random_vision_language_model(spec: ModelBuildConfig, tokenizer, seed: int):
    """A random ``Qwen2_5_VLForConditionalGeneration``: the language model of ``spec``'s sizes
    (multimodal RoPE sections: ``mrope_section``), a 2-block vision tower
    of width 32 merged into it."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text = dict(
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        intermediate_size=spec.intermediate_size,
        vocab_size=len(tokenizer),
        max_position_embeddings=spec.max_position_embeddings,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1000000.0,
            "mrope_section": mrope_section(spec.hidden_size // spec.num_heads),
        },
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=spec.tie_word_embeddings,
    )
    vision = _vision_settings(spec)
    ids = tokenizer.convert_tokens_to_ids
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids(IMAGE_PAD),
        video_token_id=ids(VIDEO_PAD),
        vision_start_token_id=ids(VISION_START),
        vision_end_token_id=ids(VISION_END),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=spec.tie_word_embeddings,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    return Qwen2_5_VLForConditionalGeneration(config).float()


def build_vision_language_dir(
    spec: ModelBuildConfig, out_dir: str | os.PathLike, corpus: list[str], seed: int
) -> Path:
    """Write processor + random Qwen2.5-VL into ``out_dir`` (atomically, as
    ``rlcli.model.builder.build_model_dir``)."""
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".building")
    processor = build_processor(corpus, spec.vocab_size)
    model = build_random_vision_language_model(spec, processor.tokenizer, seed)
    tmp.mkdir(parents=True, exist_ok=True)
    processor.save_pretrained(tmp)
    model.save_pretrained(tmp, safe_serialization=True)
    model.generation_config.eos_token_id = processor.tokenizer.eos_token_id
    model.generation_config.save_pretrained(tmp)
    tmp.rename(out)
    return out
