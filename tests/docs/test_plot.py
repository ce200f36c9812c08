"""`rlcli plot RUN_DIR`: a PNG of a run's curves from its metrics.jsonl."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _rlcli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "rlcli.cli", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_plot_writes_a_png_of_the_logged_curves(tmp_path):
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.write(json.dumps({"step": 0, "val/reward/accuracy": 0.5}) + "\n")
        for step in range(1, 11):
            record = {
                "step": step,
                "reward/accuracy": step / 10,
                "actor/pg_loss": -0.01 * step,
                "actor/ppo_kl": 1e-3,
                "timing/step": 0.3,
                "rollout/logprob_diff_max": 1e-6,
                "actor/grad_norm": math.nan,  # non-finite values are written by the logger
            }
            f.write(json.dumps(record) + "\n")
    out = tmp_path / "plots" / "run.png"
    result = _rlcli("plot", str(tmp_path), "--output", str(out))
    assert result.returncode == 0, result.stderr
    assert str(out) in result.stdout
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    for panel in ("reward", "held-out accuracy", "losses", "KL", "seconds per phase"):
        assert panel in result.stdout


def test_plot_defaults_to_curves_png_in_the_run_dir(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/accuracy": 1.0}) + "\n")
    result = _rlcli("plot", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "curves.png").stat().st_size > 0


def test_missing_or_empty_metrics_is_a_user_error(tmp_path):
    missing = _rlcli("plot", str(tmp_path))
    assert missing.returncode == 2
    assert "metrics.jsonl: no such file" in missing.stderr and "Traceback" not in missing.stderr
    (tmp_path / "metrics.jsonl").write_text("")
    empty = _rlcli("plot", str(tmp_path))
    assert empty.returncode == 2
    assert "no metrics yet" in empty.stderr and "Traceback" not in empty.stderr
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n')
    bad = _rlcli("plot", str(tmp_path))
    assert bad.returncode == 2 and "metrics.jsonl:2" in bad.stderr


def test_a_kl_that_is_zero_at_every_step_gets_no_panel(tmp_path):
    """No KL term (GRPO without use_kl_loss): its curves are exactly 0, a flat line that says
    nothing; the panel is left out. A reward of 0 at every step is a result and stays."""
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step in range(1, 6):
            record = {"step": step, "reward/accuracy": 0.0, "actor/pg_loss": 0.1}
            record.update({"algorithm/kl": 0.0, "algorithm/kl_coef": 0.0, "actor/kl_loss": 0.0})
            f.write(json.dumps(record) + "\n")
    result = _rlcli("plot", str(tmp_path))
    assert result.returncode == 0, result.stderr
    panels = result.stdout.split("; ", 1)[1]
    assert "reward (training rollouts)" in panels and "losses" in panels and "KL" not in panels
