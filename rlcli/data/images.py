"""Images in prompt rows, for vision-language models, in verl's multimodal schema::

    {"data_source": "digits",
     "prompt": [{"role": "user", "content": "<image>What is the sum of the two digits?"}],
     "images": ["images/0001.png"],
     "reward_model": {"style": "rule", "ground_truth": "9"}}

``images`` lists a row's images in the order of the ``<image>`` placeholders in its messages
(one each). An entry is a path (absolute, or relative to the data file's folder), a
``data:image/...;base64,...`` URL, or an object holding one of ``bytes`` (raw bytes, as Parquet
stores images, or base64 text), ``path`` or ``image`` (verl's key; a path or a URL). Every image
is converted to RGB.

The model's own processor (transformers' ``AutoProcessor``: its tokenizer, image processor and
chat template) then renders the messages with an image part in place of each placeholder and
turns text and images into the prompt's token ids (each image's single placeholder token expanded
to its patch tokens), ``pixel_values [patches, patch_dim]`` and ``image_grid_thw [images, 3]``:
exactly what the model's own preprocessing gives (its image processor's ``min_pixels`` /
``max_pixels`` bound each image's resized area).
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlcli.data.rows import RowLocation
from rlcli.errors import UserError

IMAGE_PLACEHOLDER = "<image>"
IMAGES_KEY = "images"
_DATA_URL = "data:image/"


@dataclass
class ProcessedPrompt:
    """A prompt with images as the model reads it (module docstring)."""

    text: str  # the rendered prompt, one placeholder token an image
    token_ids: list[int]  # each image's placeholder token expanded to its merged patches
    pixel_values: torch.Tensor  # [patches, patch_dim] float32
    image_grid_thw: torch.Tensor  # [images, 3] int64: frames, rows, columns of patches
    # [len(token_ids), 3] int64: each token's multimodal RoPE position (temporal, height,
    # width; ``parallel.vision_language.mrope_position_ids``); the text after the prompt
    # continues from ``next_position`` on all three axes.
    positions: torch.Tensor
    images: list[Any]  # the RGB PIL images (an engine that processes them itself takes these)

    @property
    def next_position(self) -> int:
        return int(self.positions.max()) + 1


def load_row_images(value: Any, location: RowLocation) -> list[Any]:
    """The row's ``images`` as RGB PIL images; a UserError naming the row and the entry for one
    that does not load."""
    if not isinstance(value, list):
        raise UserError(
            f"{location}: key {IMAGES_KEY!r} must be a list of images (paths, data URLs or "
            f'{{"bytes": ...}} objects), got {type(value).__name__}'
        )
    return [
        _load_image(entry, location, f"{IMAGES_KEY}[{position}]")
        for position, entry in enumerate(value)
    ]


def _load_image(entry: Any, location: RowLocation, key: str) -> Any:
    from PIL import Image, UnidentifiedImageError

    if isinstance(entry, dict):
        if entry.get("bytes"):
            return _open(_decoded_bytes(entry["bytes"], location, key), location, key)
        source = entry.get("path") or entry.get("image")
        if not source:
            raise UserError(
                f"{location}: key {key} holds none of 'bytes', 'path', 'image': {entry!r:.100}"
            )
        entry = source
    if isinstance(entry, bytes):
        return _open(entry, location, key)
    if not isinstance(entry, str) or not entry:
        raise UserError(
            f"{location}: key {key} must be a path, a data URL or an object, got {entry!r:.100}"
        )
    if entry.startswith(_DATA_URL):
        encoded = entry.split(",", 1)[1] if "," in entry else ""
        return _open(_decoded_bytes(encoded, location, key), location, key)
    path = Path(entry.removeprefix("file://"))
    if not path.is_absolute():
        path = Path(location.path).parent / path
    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except FileNotFoundError:
        raise UserError(f"{location}: key {key}: no image file {path}") from None
    except (UnidentifiedImageError, OSError) as err:
        raise UserError(f"{location}: key {key}: {path} is not a readable image ({err})") from None


def _decoded_bytes(value: Any, location: RowLocation, key: str) -> bytes:
    if isinstance(value, bytes):
        return value
    try:
        return base64.b64decode(str(value), validate=True)
    except (binascii.Error, ValueError):
        raise UserError(f"{location}: key {key}: the bytes are not valid base64") from None


def _open(data: bytes, location: RowLocation, key: str) -> Any:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError) as err:
        raise UserError(
            f"{location}: key {key}: the bytes are not a readable image ({err})"
        ) from None


def image_messages(
    messages: list[dict[str, str]], image_count: int, location: RowLocation, prompt_key: str
) -> list[dict[str, Any]]:
    """The messages with each ``<image>`` placeholder turned into an image part, the way chat
    templates of vision-language models take them (``{"type": "image"}`` beside
    ``{"type": "text", ...}``); a UserError naming the row when placeholders and images differ
    in number."""
    placeholders = sum(m["content"].count(IMAGE_PLACEHOLDER) for m in messages)
    if placeholders != image_count:
        raise UserError(
            f"{location}: {placeholders} {IMAGE_PLACEHOLDER} placeholder(s) in {prompt_key!r} "
            f"but {image_count} image(s) in {IMAGES_KEY!r}: write one {IMAGE_PLACEHOLDER} where "
            "each image goes, in the order of the list"
        )
    converted = []
    for message in messages:
        pieces = message["content"].split(IMAGE_PLACEHOLDER)
        parts: list[dict[str, str]] = []
        for index, text in enumerate(pieces):
            if index:
                parts.append({"type": "image"})
            if text:
                parts.append({"type": "text", "text": text})
        converted.append({"role": message["role"], "content": parts})
    return converted


def process_prompt(
    processor: Any, messages: list[dict[str, Any]], images: list[Any]
) -> ProcessedPrompt:
    """Token ids, ``pixel_values`` and ``image_grid_thw`` of ``messages`` (image parts already in
    place, ``image_messages``) and their images, by the model's processor."""
    from parallel.vision_language import mrope_position_ids

    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    out = processor(text=[text], images=images, return_tensors="pt")
    grid = out["image_grid_thw"].long()
    positions = mrope_position_ids(
        out["input_ids"], grid, processor.image_token_id, processor.image_processor.merge_size
    )
    return ProcessedPrompt(
        text=text,
        token_ids=out["input_ids"][0].tolist(),
        pixel_values=out["pixel_values"].float(),
        image_grid_thw=grid,
        positions=positions[:, 0].T.contiguous(),
        images=images,
    )


def prompt_with_images(
    processor: Any, messages: list[dict[str, str]], images: Any, location: RowLocation, key: str
) -> ProcessedPrompt:
    """A row's messages (``<image>`` placeholders in ``key``) and ``images`` value, loaded and
    processed: what the model reads."""
    loaded = load_row_images(images, location)
    return process_prompt(processor, image_messages(messages, len(loaded), location, key), loaded)


def image_question_rows(images_dir: str, questions: str, data_source: str) -> list[dict]:
    """Prompt rows from a folder of images and a file of questions about them (``.jsonl`` /
    ``.parquet``, rows ``{"image": NAME or "images": [NAMES], "question": ..., "answer": ...}``,
    names relative to ``images_dir``): each row's images as absolute paths, its question after one
    ``<image>`` placeholder per image (unless it places its own), the answer as the ground truth.
    Every image is opened once here, so a bad one is named now rather than at training time."""
    from rlcli.data.rows import read_rows

    folder = Path(images_dir)
    if not folder.is_dir():
        raise UserError(f"--images {images_dir}: no such folder")
    rows = []
    for location, raw in read_rows(questions):
        names = raw.get("images", [raw["image"]] if "image" in raw else None)
        if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
            raise UserError(
                f"{location}: needs 'image' (a file name in {images_dir}) or 'images' (a list "
                f"of them); keys present: {sorted(raw)}"
            )
        for key in ("question", "answer"):
            if not isinstance(raw.get(key), str | int | float) or raw.get(key) == "":
                raise UserError(f"{location}: missing key {key!r}")
        paths = [str((folder / name).resolve()) for name in names]
        load_row_images(paths, location)  # names the row and the image that does not load
        question = str(raw["question"])
        if IMAGE_PLACEHOLDER not in question:
            question = IMAGE_PLACEHOLDER * len(paths) + question
        rows.append(
            {
                "data_source": data_source,
                "prompt": [{"role": "user", "content": question}],
                IMAGES_KEY: paths,
                "reward_model": {"style": "rule", "ground_truth": str(raw["answer"])},
                "extra_info": {"index": len(rows), "source": str(location)},
            }
        )
    if not rows:
        raise UserError(f"{questions}: no questions")
    return rows
