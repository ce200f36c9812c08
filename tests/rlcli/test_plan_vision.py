"""`rlcli plan` for a vision-language model (Qwen2.5-VL): the tower's parameters against
transformers' own module (built on the meta device), and the plan's terms against the text model's
plus the tower, frozen and trained."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from parallel.memory_terms import (
    DTYPE_BYTES,
    TrainedModel,
    grad_bytes,
    optimizer_bytes,
    weight_bytes,
)
from parallel.model_shapes import KNOWN_SHAPES
from tests.rlcli.test_plan import run_cli

# Qwen2.5-VL-7B-Instruct's config.json vision_config (the released checkpoint's)
VISION_7B = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                 out_hidden_size=3584, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                 in_channels=3, window_size=112, fullatt_block_indexes=[7, 15, 23, 31])  # fmt: skip


@pytest.mark.parametrize("vision", [VISION_7B, dict(depth=2, hidden_size=32, intermediate_size=64,
                                                    num_heads=2, out_hidden_size=128)])  # fmt: skip
def test_the_tower_count_equals_transformers_module(vision):
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel,
    )

    from parallel.vision_shape import VisionShape

    config = Qwen2_5_VLConfig(vision_config=vision).vision_config
    with torch.device("meta"):
        tower = Qwen2_5_VisionTransformerPretrainedModel._from_config(config)
    want = sum(p.numel() for p in tower.parameters())
    assert VisionShape.from_vision_config(vision, vision["out_hidden_size"]).params == want


def test_qwen2_5_vl_7b_is_the_text_model_plus_the_tower_on_the_first_stage():
    vl, text = KNOWN_SHAPES["qwen2.5-vl-7b"], KNOWN_SHAPES["qwen2.5-7b"]
    tower = vl.vision.params
    assert 0.6e9 < tower < 0.7e9  # 0.68B of the 8.3B checkpoint
    layout = dict(dtype="bfloat16", tp=4, pp=2, dp=1, distributed_optimizer=False)
    frozen, trained = (
        TrainedModel(vl, **layout),
        TrainedModel(vl, train_vision_tower=True, **layout),
    )
    plain = TrainedModel(text, **layout)
    first_stage = [dataclasses.replace(m, pp=1) for m in (frozen, plain)]
    # the whole tower on each TP rank of the first stage, nothing on the second
    assert frozen._split(0)[0] - plain._split(0)[0] == tower
    assert frozen._split(1) == plain._split(1)
    assert (
        weight_bytes(first_stage[0]) - weight_bytes(first_stage[1])
        == tower * DTYPE_BYTES["bfloat16"]
    )
    # frozen: no gradient, no optimizer state for it; trained: both
    assert grad_bytes(frozen) == grad_bytes(plain)
    assert optimizer_bytes(frozen) == optimizer_bytes(plain)
    assert optimizer_bytes(trained) > optimizer_bytes(frozen)


def test_plan_of_qwen2_5_vl_7b_on_one_node(capsys):
    code, out, err = run_cli(
        capsys, "plan", "recipes/grpo_qwen7b.yaml", "model.path=Qwen/Qwen2.5-VL-7B-Instruct"
    )
    assert code == 0, err
    assert "vision tower: 0.677 B params (32 blocks, width 1280)" in out, out
    assert "frozen" in out and "fits" in out, out
