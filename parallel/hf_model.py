"""The one HF -> Megatron load: build this rank's model chunks for an HF model directory and fill
them from its safetensors.

    load_hf_model(hf_dir, mesh, *, dtype=torch.float32, critic=False) -> list[torch.nn.Module]

The chunks are plain (not DDP-wrapped) and carry ``chunk.hf_config``; wrap them for training
(``parallel.optim.wrap_for_training``) only after this, since wrapping copies the weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from parallel.convert import load_hf_weights
from parallel.mesh import Mesh
from parallel.model import build_model


def load_hf_model(
    hf_dir: str | Path,
    mesh: Mesh,
    *,
    dtype: torch.dtype = torch.float32,
    critic: bool = False,
    **build_options: Any,
) -> list[torch.nn.Module]:
    """Megatron chunks of this rank for the HF model in `hf_dir`, weights loaded (a critic's
    value head keeps its initialisation when the checkpoint has none). `build_options` go to
    `parallel.model.build_model` (sequence_parallel, transformer_impl, attention_backend,
    recompute, pack_sequences)."""
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(hf_dir)
    models = build_model(hf_config, mesh, dtype=dtype, critic=critic, **build_options)
    load_hf_weights(models, mesh, hf_dir)
    return models
