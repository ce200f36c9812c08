"""Runs that repeat: the same seed, thread count and layout give bitwise the same weights (SFT)
and the same metrics (GRPO at DP 2); test_run_survival.py's stopped-and-resumed GRPO run equals
the uninterrupted one with ``trainer.deterministic=true``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
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


@pytest.mark.dist
def test_two_dp2_grpo_runs_with_one_seed_give_identical_metrics(tmp_path):
    """Two `rlcli train --nproc 2` GRPO runs (DP 2, the HF engine, `trainer.deterministic=true`)
    with one seed: every metric but time and memory equal, step for step."""
    from tests.rlcli.test_run_survival import comparable, finish, rlcli_train, rows

    runs = [tmp_path / "a", tmp_path / "b"]
    procs = [rlcli_train(out, "trainer.total_steps=2", *SMALL, nproc=2) for out in runs]
    for proc in procs:  # both at once: two ranks each on two cores, one thread per rank
        code, output = finish(proc)
        assert code == 0, output[-3000:]
    first, second = (rows(out) for out in runs)
    assert [r["step"] for r in first] == [1, 2]
    assert [comparable(r) for r in first] == [comparable(r) for r in second]
    assert any(r.get("actor/pg_loss") for r in first)  # it trained
