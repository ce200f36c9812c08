"""``rlcli eval``: a model folder's held-out metrics equal those a training run of the same recipe
measures before RL; bad input exits 2 naming what to change."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.rlcli.test_train_e2e import REPO, TINY

RUN = [*TINY, "rollout.engine=hf", "trainer.val_before_train=true", "data.train_batch_size=2"]


def rlcli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "rlcli.cli", *args]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_eval_measures_what_a_run_measures_before_rl(tmp_path):
    recipe = str(REPO / "recipes" / "quickstart.yaml")
    out = tmp_path / "run"
    trained = rlcli("train", recipe, *RUN, "trainer.total_steps=1", f"trainer.output_dir={out}")
    assert trained.returncode == 0, trained.stderr[-3000:]
    before = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert before["step"] == 0

    # the start model, by --model, from an output folder of its own (data written there anew)
    evaluated = rlcli(
        "eval", recipe, *RUN, "--model", str(out / "model"), f"trainer.output_dir={tmp_path / 'e'}"
    )
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    said = {}
    for line in evaluated.stdout.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1].startswith("val/"):
            said[parts[1]] = float(parts[2])
    assert said["val/num_prompts"] == 200
    for key in ("val/reward/accuracy", "val/reward/score_mean", "val/response_length/mean"):
        assert said[key] == pytest.approx(before[key], rel=1e-3, abs=1e-6), key
    assert f"on 200 prompts ({out / 'model'}" in evaluated.stdout


def test_eval_of_a_folder_that_is_not_a_model_exits_2(tmp_path):
    recipe = str(REPO / "recipes" / "quickstart.yaml")
    proc = rlcli("eval", recipe, "--model", str(tmp_path), f"trainer.output_dir={tmp_path}")
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert f"model.path={tmp_path}" in proc.stderr and "Traceback" not in proc.stderr
