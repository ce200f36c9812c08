"""torchvision's CUDA wheel beside the CPU torch (parallel/torchvision_cpu.py, parallel/cpu_compat.py).

Each check runs in a fresh interpreter of the venv: what matters is the import order a process
meets on its own (torchvision first, or through transformers / vLLM), not this test process's.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchvision") is None or torch.version.cuda is not None,
    reason="the CPU venv's torchvision (make install); CUDA torch loads torchvision's own ops",
)


def run(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd="/"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_torchvision_imports_first_in_a_fresh_process_and_its_ops_refuse_clearly():
    out = run(
        "import torchvision, torch\n"
        "print(torchvision.extension._has_ops())\n"
        "try:\n"
        "    torchvision.ops.nms(torch.rand(2, 4), torch.rand(2), 0.5)\n"
        "except RuntimeError as error:\n"
        "    print(str(error).split('.')[0])\n"
    )
    assert out.splitlines() == ["False", "Couldn't load custom C++ ops"]


def test_the_qwen2_vl_image_processor_matches_a_hand_computed_patch():
    # One 28x28 image = one 2x2 merge of 14-pixel patches; the processor rescales to [0, 1],
    # normalises with CLIP's mean / std and lays each patch out as (channel, time, row, col)
    # with the frame repeated over temporal_patch_size 2: checked against numpy by hand.
    out = run(
        "import numpy as np, torch\n"
        "from PIL import Image\n"
        "from transformers import Qwen2VLImageProcessor\n"
        "rng = np.random.default_rng(0)\n"
        "pixels = rng.integers(0, 256, (28, 28, 3), dtype=np.uint8)\n"
        "p = Qwen2VLImageProcessor(min_pixels=28 * 28, max_pixels=28 * 28)\n"
        "got = p(images=[Image.fromarray(pixels)], return_tensors='pt')\n"
        "x = (pixels / 255.0 - np.array(p.image_mean)) / np.array(p.image_std)\n"
        "x = x.transpose(2, 0, 1)  # c, h, w\n"
        "patches = []\n"
        "for r0, c0 in ((0, 0), (0, 1), (1, 0), (1, 1)):\n"
        "    tile = x[:, r0 * 14:(r0 + 1) * 14, c0 * 14:(c0 + 1) * 14]\n"
        "    patches.append(np.stack([tile, tile], axis=1).reshape(-1))\n"
        "want = torch.tensor(np.stack(patches), dtype=torch.float32)\n"
        "print(got['image_grid_thw'].tolist())\n"
        "print(float((got['pixel_values'] - want).abs().max()))\n"
    )
    grid, error = out.splitlines()
    assert grid == "[[1, 2, 2]]"
    assert float(error) < 1e-5
