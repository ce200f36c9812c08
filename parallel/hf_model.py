"""The one HF -> Megatron load: build this rank's model chunks for an HF model directory and fill
them from its safetensors.

    load_hf_model(hf_dir, mesh, *, dtype=torch.float32, critic=False,
                  options=ModelBuildOptions()) -> list[torch.nn.Module]

The chunks are plain (not DDP-wrapped) and carry ``chunk.hf_config``; wrap them for training
(``parallel.optim.wrap_for_training``) only after this, since wrapping copies the weights.
"""

from __future__ import annotations

from pathlib import Path

import torch

from parallel.convert import load_hf_weights
from parallel.mesh import Mesh
from parallel.model import build_model
from parallel.model_options import ModelBuildOptions


def load_hf_model(
    hf_dir: str | Path,
    mesh: Mesh,
    *,
    dtype: torch.dtype = torch.float32,
    critic: bool = False,
    options: ModelBuildOptions = ModelBuildOptions(),
) -> list[torch.nn.Module]:
    """Megatron chunks of this rank for the HF model in `hf_dir`, weights loaded (a critic's
    value head keeps its initialisation when the checkpoint has none), built with `options`
    (``parallel.model.build_model``)."""
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(hf_dir)
    models = build_model(hf_config, mesh, dtype=dtype, critic=critic, options=options)
    load_hf_weights(models, mesh, hf_dir)
    return models
