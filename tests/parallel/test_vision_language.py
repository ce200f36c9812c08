"""Qwen2.5-VL on megatron-core (parallel/vision_language.py, parallel/convert/qwen2_5_vl.py),
checked against transformers' Qwen2_5_VLForConditionalGeneration on a tiny random model: the
multimodal RoPE positions, where image features land, `rlcli convert verify` with images at TP1
and TP2 (fp32 logits), the training step's own path with images (log-probs, gradients), and a
round trip through a Megatron checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from parallel.vision_language import ImageInputs, VisionLanguageModel, mrope_position_ids
from tests.parallel.dist_utils import REPO_ROOT, run_torchrun

IMAGE, VIDEO, START, END = 250, 247, 248, 249


def make_tiny_vlm(out: Path) -> Path:
    """Text: Qwen2's tiny shape (hidden 64, 4 heads of 16, 2 KV heads, vocab 251) with
    mrope_section [2, 3, 3] (half of head_dim 16); vision: 2 blocks of width 32 (the second
    with full attention, the first windowed), merged 2 x 2 into the text width. Norms and
    biases randomised so that a mapping mistake shows."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text = dict(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96, vocab_size=251, max_position_embeddings=128, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0, "mrope_section": [2, 3, 3]},
    )  # fmt: skip
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  fullatt_block_indexes=[1])  # fmt: skip
    config = Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=VIDEO,
        vision_start_token_id=START, vision_end_token_id=END, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                param.normal_(mean=1.0 if "norm" in name else 0.0, std=0.1)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory) -> Path:
    return make_tiny_vlm(tmp_path_factory.mktemp("qwen2_5_vl"))


def test_mrope_positions_equal_transformers_get_rope_index(tiny_vlm):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm, dtype=torch.float32)
    # row 0: two images (4 x 6 and 2 x 2 patches -> 2 x 3 and 1 x 1 merged) between text;
    # row 1: left padding, then one 4 x 4 image
    grids = torch.tensor([[1, 4, 6], [1, 2, 2], [1, 4, 4]])
    row0 = [5, START, *[IMAGE] * 6, END, 7, 8, START, IMAGE, END, 9, 10, 11, 12, 13, 14]
    row1 = [0, 0, 0, 3, START, *[IMAGE] * 4, END, *range(20, 30)]
    ids = torch.tensor([row0, row1])
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    want, _ = model.model.get_rope_index(
        ids, (ids == IMAGE).int(), image_grid_thw=grids, attention_mask=mask
    )
    got = mrope_position_ids(ids, grids, IMAGE, spatial_merge_size=2, attention_mask=mask)
    assert torch.equal(got, want)
    assert got[:, 0, 2:8].tolist() == [[2] * 6, [2, 2, 2, 3, 3, 3], [2, 3, 4, 2, 3, 4]]


def test_image_features_replace_the_placeholders_row_by_row(tiny_vlm):
    # Only the placement: a stand-in embedding of zeros, transformers' own vision tower.
    from transformers import AutoModelForImageTextToText

    tower = AutoModelForImageTextToText.from_pretrained(tiny_vlm, dtype=torch.float32).model.visual
    ids = torch.tensor([[1, IMAGE, IMAGE, 2], [IMAGE, 3, 4, IMAGE]])  # [b, s]
    grids = torch.tensor([[1, 2, 4], [1, 2, 4]])  # two images of 2 merged patches each
    pixels = torch.randn(16, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(1))
    stub = SimpleNamespace(
        embedding=lambda input_ids, position_ids: torch.zeros(4, 2, 64),  # [s, b, h]
        visual=tower, image_token_id=IMAGE,
    )  # fmt: skip
    placed = VisionLanguageModel.embed_with_images(stub, ids, ImageInputs(pixels, grids))
    with torch.no_grad():
        features = tower(pixels, grid_thw=grids).pooler_output  # 4 rows, in image order
    got = placed.transpose(0, 1)[ids == IMAGE]  # row by row of the batch
    assert torch.allclose(got, features) and placed.transpose(0, 1)[ids != IMAGE].abs().max() == 0

    one_short = ids.clone()
    one_short[1, 3] = 4  # 3 placeholders for 2 images of 2 features each
    with pytest.raises(ValueError, match="3 image placeholder tokens .* but 4 image features"):
        VisionLanguageModel.embed_with_images(stub, one_short, ImageInputs(pixels, grids))


def rlcli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlcli.cli", *args], cwd=REPO_ROOT, capture_output=True,
        text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip


@pytest.mark.parametrize(
    "layout", [pytest.param(["--tp", "1"], id="tp1"),
               pytest.param(["--tp", "2"], id="tp2", marks=pytest.mark.dist)],
)  # fmt: skip
def test_convert_verify_with_images(tiny_vlm, layout):
    proc = rlcli("convert", "verify", "--model", str(tiny_vlm), "--tolerance", "1e-4", *layout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "round trip of 81 tensors: exact" in proc.stdout, proc.stdout


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.dist)])
def test_the_step_path_carries_images_and_matches_transformers(tiny_vlm, tp):
    # micro-batches of 1 and 2 rows through parallel.schedule: per-token log-probs against
    # transformers' within 1e-5, then gradients on the language model only
    script = Path(__file__).with_name("vision_language_worker.py")
    out = run_torchrun(script, tp, str(tiny_vlm), str(tp))
    assert f"OK tp={tp}" in out, out[-3000:]


@pytest.mark.dist
def test_round_trip_through_a_megatron_checkpoint(tiny_vlm, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    megatron, back = tmp_path / "mcore", tmp_path / "hf"
    proc = rlcli("convert", "hf-to-mcore", "--model", str(tiny_vlm), "--out", str(megatron))
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = rlcli("convert", "mcore-to-hf", "--ckpt", str(megatron), "--out", str(back), "--tp", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    before, after = load_file(tiny_vlm / "model.safetensors"), load_file(back / "model.safetensors")
    assert set(after) == set(before) and any(name.startswith("visual.") for name in after)
    assert all(torch.equal(after[name], before[name]) for name in before)
    assert AutoConfig.from_pretrained(back).architectures == ["Qwen2_5_VLForConditionalGeneration"]


def test_plan_counts_the_tower_of_a_checkpoint_folder(tiny_vlm):
    # (training one: tests/rlcli/test_vision_language_rl.py; the counts: tests/rlcli/test_plan_vision.py)
    recipe = str(REPO_ROOT / "recipes" / "quickstart.yaml")
    proc = rlcli("plan", recipe, f"model.path={tiny_vlm}", "model.build=false")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "vision tower: 0.000 B params (2 blocks, width 32)" in proc.stdout, proc.stdout
