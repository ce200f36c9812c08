"""The language model inside a multimodal checkpoint, written out as a text model folder.

Qwen3.5 is released as one multimodal checkpoint (config.json `model_type` `qwen3_5` or
`qwen3_5_moe`, `Qwen3_5ForConditionalGeneration`): a vision tower (`model.visual.*`), the language
model (`model.language_model.*`, its settings in `text_config`) and `lm_head`. rlcli trains text,
and its families map the text model's own layout (`model.layers.*`, as `Qwen3_5ForCausalLM` saves
it), so the language model is taken out once into a folder of its own; trained, it exports, syncs
to vLLM and loads in transformers as that text model. The vision tower is left behind (and any
other part outside the language model, such as multi-token-prediction heads), counted in the
summary.

    language_model_type(config) -> str | None       the wrapped text model's type, if one rlcli has
                                                    (in registry.py: hf_io's checks ask it too)
    text_settings(config) -> dict                   its settings (what `rlcli plan` sizes)
    extract_language_model(src, dst) -> Extracted   stream the tensors, write config and tokenizer

Tensors stream one at a time (shards of at most 4 GiB), so a checkpoint larger than memory is fine.
"""

from __future__ import annotations

import json
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from parallel.convert.hf_io import HFCheckpointReader, ShardWriter, copy_tokenizer_files
from parallel.convert.registry import language_model_type

LANGUAGE_MODEL_PREFIX = "model.language_model."
TEXT_PREFIX = "model."
# Settings a multimodal config may hold at its top level only; the text model needs them.
SHARED_SETTINGS = ("tie_word_embeddings", "dtype", "torch_dtype", "eos_token_id", "pad_token_id")


@dataclass(frozen=True)
class Extracted:
    model_type: str
    architecture: str
    tensors: int
    left_behind: dict[str, int]  # top-level name prefix -> tensors not in the text model

    def describe(self) -> str:
        behind = ", ".join(f"{name}.* ({count})" for name, count in self.left_behind.items())
        return (
            f"{self.tensors} tensors of the language model as {self.architecture} "
            f"(model_type {self.model_type}); left behind: {behind or 'nothing'}"
        )


def text_settings(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's settings: `text_config`, with the outer settings it lacks."""
    text = dict(config["text_config"])
    for key in SHARED_SETTINGS:
        if key in config and key not in text:
            text[key] = config[key]
    return text


def text_model_config(config: dict[str, Any]) -> dict[str, Any]:
    """config.json of the text model: its settings and the causal-LM class transformers and
    vLLM load it as."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    text = text_settings(config)
    text["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[text["model_type"]]]
    return text


def text_name(name: str) -> str | None:
    """The text model's name for a multimodal checkpoint's tensor; None when it is not part of
    the language model."""
    if name.startswith(LANGUAGE_MODEL_PREFIX):
        return TEXT_PREFIX + name.removeprefix(LANGUAGE_MODEL_PREFIX)
    if name.startswith("lm_head."):
        return name
    return None


def _part(name: str) -> str:
    """`model.visual` for `model.visual.blocks.0...`, `mtp` for `mtp.layers.0...`."""
    parts = name.split(".")
    return ".".join(parts[:2] if parts[0] == "model" else parts[:1])


def extract_language_model(src: str | Path, dst: str | Path) -> Extracted:
    """Write the language model of the multimodal checkpoint in `src` as a text model folder
    `dst` (safetensors, config.json, tokenizer and generation config). ValueError when `src`
    holds no language model rlcli has a family for."""
    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    if language_model_type(config) is None:
        raise ValueError(
            f"{src / 'config.json'} (model_type {config.get('model_type')!r}) is not a "
            "multimodal checkpoint around a language model rlcli has a family for"
        )
    text_config = text_model_config(config)
    left_behind: Counter[str] = Counter()
    kept = 0
    with ExitStack() as stack:
        reader = HFCheckpointReader(src, stack)
        writer = ShardWriter(dst)
        for name in sorted(reader.weight_map):
            new_name = text_name(name)
            if new_name is None:
                left_behind[_part(name)] += 1
                continue
            writer.add(new_name, reader(name, None, 0, 0))
            kept += 1
        if kept == 0:
            raise ValueError(f"{src} has no {LANGUAGE_MODEL_PREFIX}* tensors")
        writer.close()
    (dst / "config.json").write_text(json.dumps(text_config, indent=2) + "\n")
    copy_tokenizer_files(src, dst)
    return Extracted(
        model_type=text_config["model_type"],
        architecture=text_config["architectures"][0],
        tensors=kept,
        left_behind=dict(sorted(left_behind.items())),
    )
