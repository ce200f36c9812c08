"""What `rlcli plan` counts of a vision-language model's vision tower (Qwen2.5-VL's).

The tower and its patch merger are transformers' own module, held whole on the first pipeline
stage of every TP rank (``parallel.vision_language``), frozen unless the run trains it; vLLM
holds it whole too. Its parameters, from the checkpoint's ``vision_config``: the patch embedding
(a bias-free Conv3d over ``in_channels x temporal_patch x patch x patch``), ``depth`` blocks
(two RMSNorms, a fused qkv and a projection with biases, a gated MLP with biases) and the merger
(an RMSNorm, then two linears with biases from ``merge^2`` patches to the language model's
width). Counted against transformers' module on the meta device in the tests.

The image tokens themselves are prompt tokens (the processor expands each image's placeholder to
its merged patches, and prompts longer than ``data.max_prompt_length`` are dropped), so the
language model's activations already count them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class VisionShape:
    depth: int
    hidden: int
    ffn: int
    out_hidden: int  # the language model's width
    patch_dim: int  # in_channels * temporal_patch_size * patch_size^2
    merge: int  # spatial_merge_size: merge x merge patches become one image token

    @classmethod
    def from_vision_config(cls, vision: dict[str, Any], text_hidden: int) -> VisionShape:
        """From config.json's ``vision_config`` (transformers' defaults where it is silent)."""
        patch = vision.get("patch_size", 14)
        return cls(
            depth=vision.get("depth", 32),
            hidden=vision.get("hidden_size", 1280),
            ffn=vision.get("intermediate_size", 3420),
            out_hidden=vision.get("out_hidden_size", text_hidden),
            patch_dim=vision.get("in_channels", 3)
            * vision.get("temporal_patch_size", 2)
            * patch**2,
            merge=vision.get("spatial_merge_size", 2),
        )

    @property
    def params(self) -> int:
        h, f = self.hidden, self.ffn
        block = 2 * h + (h * 3 * h + 3 * h) + (h * h + h) + 2 * (h * f + f) + (f * h + h)
        merged = h * self.merge**2
        merger = h + (merged * merged + merged) + (merged * self.out_hidden + self.out_hidden)
        return self.patch_dim * h + self.depth * block + merger
