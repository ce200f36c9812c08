"""``rlcli top RUN_DIR``: the view of a run folder, checked on its text output."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from rlcli.cli import app
from rlcli.run.metrics import MetricsLogger
from rlcli.run.system_metrics import SystemMonitor

STEP_SECONDS = {1: 4.0, 2: 2.0, 3: 3.0}


def make_run(run_dir, total_steps: int | None):
    """Three steps written by the real logger (jsonl), with this process's system figures;
    a checkpoint at step 3 recording the planned total; then a line cut short mid-write."""
    logger = MetricsLogger(run_dir, backends=("jsonl",))
    monitor = SystemMonitor()
    for step, seconds in STEP_SECONDS.items():
        record = {"timing/step": seconds, "timing/gen": seconds / 2, "timing/update": 0.25}
        record.update({"reward/score_mean": 0.125 * step, **monitor.sample()})
        if step == 2:
            record["val/reward/accuracy"] = 0.625
        logger.log(step, record)
    logger.close()
    if total_steps is not None:
        state = run_dir / "checkpoints" / "step_000003" / "trainer_state.json"
        state.parent.mkdir(parents=True)
        state.write_text(json.dumps({"step": 3, "settings": {"trainer.total_steps": total_steps}}))
    with open(run_dir / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 4, "timing/st')  # the running trainer is writing step 4
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[2])


def top(run_dir) -> str:
    result = CliRunner().invoke(app, ["top", str(run_dir), "--once"], terminal_width=100)
    assert result.exit_code == 0, result.output
    return result.output


def test_a_running_run_shows_its_step_eta_phases_resources_and_held_out_accuracy(tmp_path):
    last = make_run(tmp_path, total_steps=7)
    text = top(tmp_path)
    # 3 s / step over the last steps (4, 2, 3), 4 steps to go: 12 s
    assert "step 3 of 7 | 3.0 s/step | eta 0m12s" in text
    assert "seconds per phase" in text and "gen" in text and "1.50" in text
    assert f"{last['system/host_rss_gb']:.2f} GB" in text
    assert f"{last['system/cpu_util_percent']:.0f}%" in text
    assert "0.375" in text  # the last reward
    assert "held-out accuracy (step 2)" in text and "62.5%" in text


def test_a_run_without_a_checkpoint_shows_no_total_and_a_missing_folder_exits_2(tmp_path):
    make_run(tmp_path / "run", total_steps=None)
    text = top(tmp_path / "run")
    assert "step 3 | 3.0 s/step" in text and "eta" not in text
    result = CliRunner().invoke(app, ["top", str(tmp_path / "nothing"), "--once"])
    assert result.exit_code != 0 and "no metrics.jsonl" in str(result.exception)
