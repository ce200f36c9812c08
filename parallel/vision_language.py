"""Vision-language models on megatron-core: transformers' vision tower in front of the GPT model.

    multimodal_parts(hf_config) -> (text_config, multimodal_config | None)   (parallel.convert)
    VisionLanguageModel            megatron's GPTModel with the vision tower on its first stage
    ImageInputs                    a micro-batch's images: patches and their grids
    mrope_position_ids(input_ids, grid_thw, image_token_id, spatial_merge_size, attention_mask)
                                   [3, b, s] multimodal RoPE positions (temporal, height, width)
    verify_batch(multimodal_config, vocab_size, batch, length) -> VerifyBatch
                                   a fixed batch with one image per row (`rlcli convert verify`)

Qwen2.5-VL's checkpoint is one folder: a vision tower and merger (`model.visual.*`), a Qwen2
language model (`model.language_model.*`, its settings in config.json's `text_config`) and
`lm_head`. The language model is megatron-core's GPTModel (TP / PP / DP as for any Qwen2, with
megatron's multimodal rotary embedding, `position_embedding_type="mrope"`). The vision tower is
transformers' own module (the same code the HF model runs; megatron-core ships no Qwen2.5-VL
vision encoder: its MIMO model takes an encoder module from outside too, and passes no
multimodal position ids), held whole on the first pipeline stage of every TP rank: it is small
beside the language model (0.68B of Qwen2.5-VL-7B's 8.3B) and frozen by default, as peers train
it. Its image features replace the embeddings of the image placeholder tokens, in the order
transformers places them (row by row of the batch), before the first decoder layer.

Position ids: text tokens count up on all three axes; an image's merged patches take
(start, start + row, start + column) with the same start on the temporal axis, and the text after
it continues from start + max(rows, columns), as transformers' `get_rope_index` computes
(checked against it in the tests). Text-only inputs use the same 1-D position on all three axes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.models.gpt import GPTModel


@dataclass(frozen=True)
class ImageInputs:
    """The images of a micro-batch, in the order their placeholder tokens appear (row by row):
    `pixel_values` [patches, channels * temporal_patch * patch * patch] as the model's image
    processor makes them, `grid_thw` [images, 3] each image's (frames, rows, columns) of
    patches."""

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    # Each row's patches (its images' share of pixel_values), when the rows may hold the image
    # token beyond their images' placeholders: a response the policy sampled can contain it,
    # and the engines read such a token as text. None: every image token is a placeholder.
    row_patches: tuple[int, ...] | None = None

    def to(self, device: torch.device) -> ImageInputs:
        return ImageInputs(self.pixel_values.to(device), self.grid_thw.to(device), self.row_patches)


def build_vision_tower(multimodal_config: Any, trainable: bool) -> torch.nn.Module:
    """transformers' vision tower (and patch merger) for the checkpoint's `vision_config`,
    randomly initialised (`parallel.convert` loads it), frozen unless `trainable`."""
    import transformers

    from parallel.convert.registry import get_family

    tower_class = getattr(transformers, get_family(multimodal_config.model_type).vision_tower)
    tower = tower_class._from_config(multimodal_config.vision_config)
    tower.requires_grad_(trainable)
    return tower


def vision_language_kwargs(
    multimodal_config: Any, pre_process: bool, train_tower: bool = False
) -> dict[str, Any]:
    """VisionLanguageModel's own constructor arguments for one chunk (the tower on the first
    stage only; frozen unless `train_tower`). A trained tower is whole on every TP rank and
    sees the same input there; its gradient is the same on each too (the language model's
    column-parallel layers all-reduce the gradient of their input), so data parallelism alone
    reduces it, and megatron counts it once in the gradient norm (no `tensor_model_parallel`
    attribute: a TP duplicate)."""
    tower = build_vision_tower(multimodal_config, train_tower) if pre_process else None
    return {"vision_tower": tower, "image_token_id": multimodal_config.image_token_id}


class VisionLanguageModel(GPTModel):
    """GPTModel whose first stage runs the vision tower and places its features (module
    docstring). Forward takes `images=ImageInputs` besides GPTModel's arguments; position ids
    are [3, b, s] (`mrope_position_ids`) or [b, s] for text alone."""

    def __init__(self, *args, vision_tower: torch.nn.Module | None, image_token_id: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.visual = vision_tower if self.pre_process else None
        self.image_token_id = image_token_id

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, *args,
                images: ImageInputs | None = None, **kwargs):  # fmt: skip
        if position_ids is not None and position_ids.dim() == 2:
            position_ids = position_ids.unsqueeze(0).expand(3, -1, -1)
        if self.pre_process and decoder_input is None and images is not None:
            decoder_input = self.embed_with_images(input_ids, images)
        return super().forward(input_ids, position_ids, attention_mask, decoder_input, *args,
                               **kwargs)  # fmt: skip

    def embed_with_images(self, input_ids: torch.Tensor, images: ImageInputs) -> torch.Tensor:
        """Token embeddings [s, b, h] with the image placeholders' rows replaced by the vision
        tower's features."""
        embeddings = self.embedding(input_ids=input_ids, position_ids=None)
        dtype = next(self.visual.parameters()).dtype
        features = self.visual(images.pixel_values.to(dtype), grid_thw=images.grid_thw)
        features = features.pooler_output  # the merger's output: one row per placeholder
        slots = input_ids == self.image_token_id
        if images.row_patches is not None:
            # a row's first placeholders are its prompt's; later image tokens are sampled text
            placeholders = torch.tensor(images.row_patches, device=slots.device)
            placeholders = placeholders // self.visual.spatial_merge_unit
            slots &= slots.cumsum(dim=1) <= placeholders[:, None]
        if int(slots.sum()) != features.shape[0]:
            raise ValueError(
                f"{int(slots.sum())} image placeholder tokens (id {self.image_token_id}) but "
                f"{features.shape[0]} image features: the prompt and its images disagree"
            )
        batch_first = embeddings.transpose(0, 1)
        placed = batch_first.masked_scatter(slots.unsqueeze(-1), features.to(embeddings.dtype))
        return placed.transpose(0, 1).contiguous()


def mrope_position_ids(
    input_ids: torch.Tensor,
    grid_thw: torch.Tensor | None,
    image_token_id: int,
    spatial_merge_size: int,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Multimodal RoPE positions [3, b, s] of `input_ids` [b, s] (module docstring); padding
    (attention_mask 0) keeps position 0. Images are consumed in order, one grid each."""
    batch, length = input_ids.shape
    positions = torch.zeros(3, batch, length, dtype=torch.long, device=input_ids.device)
    grids = iter(grid_thw.tolist() if grid_thw is not None else [])
    for row in range(batch):
        keep = (
            attention_mask[row].bool()
            if attention_mask is not None
            else torch.ones(length, dtype=torch.bool, device=input_ids.device)
        )
        ids = input_ids[row][keep].tolist()
        pieces, start, i = [], 0, 0
        while i < len(ids):
            if ids[i] == image_token_id:
                frames, rows, columns = next(grids)
                rows, columns = rows // spatial_merge_size, columns // spatial_merge_size
                grid = torch.stack(
                    torch.meshgrid(
                        torch.arange(frames), torch.arange(rows), torch.arange(columns),
                        indexing="ij",
                    )
                ).reshape(3, -1)  # fmt: skip
                pieces.append(grid + start)
                start += max(rows, columns)
                i += frames * rows * columns
            else:
                end = i
                while end < len(ids) and ids[end] != image_token_id:
                    end += 1
                pieces.append(torch.arange(end - i).expand(3, -1) + start)
                start += end - i
                i = end
        if pieces:
            positions[:, row, keep] = torch.cat(pieces, dim=1).to(positions.device)
    return positions


@dataclass(frozen=True)
class VerifyBatch:
    tokens: torch.Tensor  # [b, s]
    positions: torch.Tensor  # [3, b, s]
    images: ImageInputs

    def hf_inputs(self, image_token_id: int) -> dict[str, torch.Tensor]:
        """The same batch as transformers' vision-language models take it."""
        return {
            "input_ids": self.tokens,
            "pixel_values": self.images.pixel_values,
            "image_grid_thw": self.images.grid_thw,
            "mm_token_type_ids": (self.tokens == image_token_id).int(),
        }


def verify_batch(config: Any, vocab_size: int, batch: int, length: int) -> VerifyBatch:
    """`batch` rows of `length` random text tokens, each with one image of 4 x 4 patches
    (random pixels: what matters is that both implementations see the same) between the
    vision start / end tokens at position 3; seeded, the same on every rank."""
    vision = config.vision_config
    merge = vision.spatial_merge_size
    grid = (1, 2 * merge, 2 * merge)
    placeholders = grid[0] * grid[1] * grid[2] // merge**2
    special = (
        config.image_token_id, config.vision_start_token_id, config.vision_end_token_id,
        config.video_token_id,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, min(min(special), vocab_size), (batch, length), generator=generator)
    image = [config.vision_start_token_id, *[config.image_token_id] * placeholders,
             config.vision_end_token_id]  # fmt: skip
    tokens[:, 3 : 3 + len(image)] = torch.tensor(image)
    patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    pixels = torch.randn(batch * grid[0] * grid[1] * grid[2], patch, generator=generator)
    grid_thw = torch.tensor([grid] * batch)
    positions = mrope_position_ids(tokens, grid_thw, config.image_token_id, merge)
    return VerifyBatch(tokens, positions, ImageInputs(pixels, grid_thw))
