"""`rlcli convert` (Megatron work in parallel.parity): torchrun relaunch, HF <-> mcore, verify."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from rlcli.commands.convert import convert_app
from rlcli.errors import UserError
from tests.parallel.dist_utils import REPO_ROOT


def _convert(*args: str) -> str:
    """Run `rlcli convert ARGS` as a user would; returns its stdout."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run(
        [sys.executable, "-m", "rlcli.cli", "convert", *map(str, args)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout


def test_model_folder_without_config_is_a_user_error(tmp_path):
    result = CliRunner().invoke(convert_app, ["verify", "--model", str(tmp_path)])
    assert isinstance(result.exception, UserError)
    assert "no config.json" in str(result.exception)


@pytest.mark.dist
def test_hf_to_mcore_to_hf_round_trip_across_layouts(tiny_qwen2_tied_dir, tmp_path):
    # written at TP2, read back at PP2: both relaunch under torchrun with 2 processes
    _convert("hf-to-mcore", "--model", tiny_qwen2_tied_dir, "--out", tmp_path / "mc", "--tp", 2)
    _convert("mcore-to-hf", "--ckpt", tmp_path / "mc", "--out", tmp_path / "hf", "--pp", 2)

    original = load_file(tiny_qwen2_tied_dir / "model.safetensors")
    restored = load_file(tmp_path / "hf" / "model.safetensors")
    assert restored.keys() == original.keys()
    assert all(torch.equal(restored[name], original[name]) for name in original)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config == json.loads((tiny_qwen2_tied_dir / "config.json").read_text())


@pytest.mark.dist
def test_verify_reports_logit_difference_and_exact_round_trip(tiny_llama_dir):
    # one process: the torchrun relaunch is exercised by the round-trip test above
    output = _convert("verify", "--model", tiny_llama_dir)
    print(output)
    diff = float(re.search(r"logit difference: (\S+)", output).group(1))
    assert diff < 1e-4
    assert re.search(r"round trip of \d+ tensors: exact", output), output


@pytest.mark.dist
def test_verify_a_moe_model_at_ep2(tiny_qwen3_moe_dir):
    # --ep 2 relaunches itself under torchrun with tp * pp * ep = 2 processes
    output = _convert("verify", "--model", tiny_qwen3_moe_dir, "--ep", 2)
    print(output)
    assert "layout tp=1 pp=1 ep=2 expert_tp=1" in output
    assert float(re.search(r"logit difference: (\S+)", output).group(1)) < 1e-4
    assert re.search(r"round trip of \d+ tensors: exact", output), output


@pytest.mark.parametrize(
    "fixture, ep, needle",
    [
        ("tiny_qwen3_moe_dir", "3", "--ep 3 must divide the model's 8 experts"),
        ("tiny_llama_dir", "2", "dense model"),
    ],
)
def test_verify_expert_layout_errors(fixture, ep, needle, request):
    model = request.getfixturevalue(fixture)
    result = CliRunner().invoke(convert_app, ["verify", "--model", str(model), "--ep", ep])
    assert isinstance(result.exception, UserError), result.output
    assert needle in str(result.exception)
