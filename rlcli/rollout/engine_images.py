"""Prompts with images, as each engine takes them (vision-language models).

A prompt's token ids carry each image's placeholder expanded to one token a merged patch block
(what the trainer reads, ``rlcli.data.images``). vLLM takes the images themselves
(``multi_modal_data``) and expands the placeholders on its own: given already expanded ids it
expands every one of them again (checked with vLLM 0.32's Qwen2.5-VL: two placeholders became
three), so it gets each image's run collapsed to the single token the chat template wrote.
transformers' ``generate`` takes the processor's ``pixel_values`` / ``image_grid_thw`` beside the
expanded ids, and marks the image tokens in ``mm_token_type_ids`` (without it Qwen2.5-VL falls
back to 1-D positions).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from rlcli.errors import UserError

if TYPE_CHECKING:
    from rlcli.rollout.base import GenerationRequest


def image_token_of(hf_config: dict[str, Any]) -> int | None:
    """The image placeholder token of a vision-language model's config.json; None for a text
    model (whose engine takes no images)."""
    return hf_config.get("image_token_id") if "vision_config" in hf_config else None


def collapsed_placeholders(token_ids: list[int], image_token_id: int) -> list[int]:
    """``token_ids`` with every run of the image token cut to one token."""
    return [
        token
        for i, token in enumerate(token_ids)
        if token != image_token_id or i == 0 or token_ids[i - 1] != image_token_id
    ]


def vllm_prompt(request: GenerationRequest, image_token_id: int | None) -> Any:
    """vLLM's ``TokensPrompt`` for ``request`` (module docstring)."""
    from vllm.inputs import TokensPrompt

    if request.images is None:
        return TokensPrompt(prompt_token_ids=list(request.prompt_token_ids))
    return TokensPrompt(
        prompt_token_ids=collapsed_placeholders(request.prompt_token_ids, image_token_id),
        multi_modal_data={"image": list(request.images.images)},
    )


def hf_image_inputs(
    requests: list[GenerationRequest], input_ids: torch.Tensor, image_token_id: int | None
) -> dict[str, torch.Tensor]:
    """``generate``'s image arguments for ``requests`` laid out as the rows of ``input_ids``
    (their images in row order); nothing when none has images."""
    with_images = [r.images for r in requests if r.images is not None]
    if not with_images:
        return {}
    device = input_ids.device
    return {
        "pixel_values": torch.cat([i.pixel_values for i in with_images]).to(device),
        "image_grid_thw": torch.cat([i.image_grid_thw for i in with_images]).to(device),
        "mm_token_type_ids": (input_ids == image_token_id).int(),
    }


def check_takes_images(requests: list[GenerationRequest], takes_images: bool, engine: str) -> None:
    """A request with images for an engine whose model reads none is a configuration error."""
    if not takes_images and any(r.images is not None for r in requests):
        raise UserError(
            f"prompts with images reached the {engine} engine of a text-only model: point "
            "model.path at a vision-language model (Qwen2.5-VL), or drop the rows' 'images'"
        )
