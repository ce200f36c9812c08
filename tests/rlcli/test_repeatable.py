"""Runs that repeat: the same seed, thread count and layout give bitwise the same weights
(SFT here; GRPO in test_run_survival.py, whose stopped-and-resumed run equals the uninterrupted
one with ``trainer.deterministic=true``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.rlcli.test_cli_errors import QUICKSTART, REPO

SMALL = ["model.spec.num_layers=2", "sft.steps=30", "trainer.deterministic=true"]


def sft(out: Path) -> dict[str, torch.Tensor]:
    proc = subprocess.run(
        [sys.executable, "-m", "rlcli.cli", "sft", QUICKSTART, *SMALL, f"trainer.output_dir={out}"],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    weights = {}
    for shard in sorted((out / "sft_model").glob("*.safetensors")):
        weights.update(load_file(shard))
    return weights


def test_two_sft_warm_starts_with_one_seed_give_identical_weights(tmp_path):
    first, second = sft(tmp_path / "a"), sft(tmp_path / "b")
    assert first.keys() == second.keys() and len(first) > 0
    for name in first:
        assert torch.equal(first[name], second[name]), name
    start = load_file(next((tmp_path / "a" / "model").glob("*.safetensors")))
    assert any(not torch.equal(start[k], first[k]) for k in start)  # it trained


def test_deterministic_mode_switches_torch_to_deterministic_algorithms():
    program = (
        "import torch; from rlcli.machine import make_repeatable; "
        "assert not torch.are_deterministic_algorithms_enabled(); make_repeatable(); "
        "import os; print(torch.are_deterministic_algorithms_enabled(), "
        "os.environ['CUBLAS_WORKSPACE_CONFIG'])"
    )
    shown = subprocess.run(
        [sys.executable, "-c", program], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert shown.stdout.split() == ["True", ":4096:8"], shown.stderr[-2000:]
