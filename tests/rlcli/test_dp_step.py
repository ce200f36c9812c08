"""Data parallelism without a global batch: each DP rank computes on its own whole groups.

Runs ``dp_step_worker.py`` under torchrun (2 CPU processes, DP2)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.parallel.dist_utils import run_torchrun
from tests.rlcli.test_train_e2e import REPO, TINY

WORKER = Path(__file__).with_name("dp_step_worker.py")


@pytest.mark.dist
def test_dp2_advantages_equal_the_whole_batch_computation(tmp_path):
    out = tmp_path / "worst.json"
    run_torchrun(WORKER, 2, "advantages", str(out), timeout_s=300)
    worst = json.loads(out.read_text())
    assert len(worst) == 14
    for name, diff in worst.items():
        assert diff < 1e-5, (name, diff)


@pytest.mark.dist
def test_dp2_step_hands_collectives_only_model_device_tensors(tmp_path):
    out = tmp_path / "audit.json"
    overrides = [*TINY, "rollout.engine=hf", f"trainer.output_dir={tmp_path / 'run'}"]
    recipe = str(REPO / "recipes" / "quickstart.yaml")
    run_torchrun(WORKER, 2, "step", str(out), recipe, *overrides, timeout_s=600)
    result = json.loads(out.read_text())
    assert result["offenders"] == []
    assert result["calls"].get("all_reduce", 0) > 0  # the audit saw the step's reductions
    metrics = result["metrics"]
    assert "actor/pg_loss" in metrics and metrics["actor/skipped_steps"] == 0.0
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert metrics["rollout/logprob_diff_max"] < 1e-3
