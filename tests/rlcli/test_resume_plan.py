"""What ``rlcli train`` says and does before any work when its folder already holds a run
(``rlcli.run.resume_plan``): refused settings, "nothing to do", or a resume that lists what
changed. The checkpoints here are written the way a run writes them (a ``step_N`` folder with its
COMPLETE marker and run state); test_run_survival checks the same against a real run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlcli.errors import UserError
from rlcli.run.checkpoints import COMPLETE_MARKER, step_dir_name
from rlcli.run.manifest import write_manifest
from rlcli.run.resume_plan import changed_settings, plan_resume, run_settings
from rlcli.run.state import TRAINER_STATE_FILE, RunState
from rlcli.validation.loader import load_config

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "quickstart.yaml"


def _config(out: Path, *overrides: str):
    return load_config(RECIPE, [f"trainer.output_dir={out}", "trainer.total_steps=5", *overrides])


def _checkpoint(out: Path, step: int, settings: dict | None) -> Path:
    folder = out / "checkpoints" / step_dir_name(step)
    folder.mkdir(parents=True)
    state = RunState(step=step, loader={"epoch": 0}, kl_coef=0.0, settings=settings)
    (folder / TRAINER_STATE_FILE).write_text(json.dumps(state.to_dict()))
    (folder / COMPLETE_MARKER).write_text("")
    return folder


def test_a_fresh_folder_or_resume_none_plans_nothing(tmp_path):
    assert plan_resume(_config(tmp_path / "run")) is None
    _checkpoint(tmp_path / "run", 3, run_settings(_config(tmp_path / "run")))
    assert plan_resume(_config(tmp_path / "run", "trainer.resume=none")) is None


def test_a_finished_run_has_nothing_to_do(tmp_path):
    out = tmp_path / "run"
    folder = _checkpoint(out, 5, run_settings(_config(out)))
    plan = plan_resume(_config(out))
    assert plan is not None and plan.nothing_to_do and plan.step == 5
    assert plan.message.startswith(f"nothing to do: {folder} is at step 5")
    assert "trainer.total_steps=5" in plan.message
    plan = plan_resume(_config(out, "trainer.total_steps=8"))  # more steps: a resume
    assert plan is not None and not plan.nothing_to_do
    assert plan.message == f"resuming from step 5 ({folder})"


def test_settings_a_resume_cannot_change_are_refused_by_name(tmp_path):
    out = tmp_path / "run"
    _checkpoint(out, 2, run_settings(_config(out)))
    changed = _config(out, "algorithm.adv_estimator=rloo", "sft.steps=7", "actor.lr=1e-5")
    with pytest.raises(UserError) as error:
        plan_resume(changed)
    message = str(error.value)
    assert "algorithm.adv_estimator 'grpo' -> 'rloo'" in message
    assert "sft.steps" in message and "actor.lr" not in message  # only the refused ones
    assert "trainer.output_dir=<another folder>" in message and "trainer.resume=none" in message


def test_a_resume_lists_the_settings_that_differ(tmp_path):
    out = tmp_path / "run"
    saved = run_settings(_config(out))
    folder = _checkpoint(out, 2, saved)
    plan = plan_resume(_config(out, "actor.lr=1e-5", "rollout.n=4"))
    assert plan is not None and not plan.nothing_to_do
    assert plan.message == (
        f"resuming from step 2 ({folder}); with the current config's values: "
        f"actor.lr {saved['actor.lr']!r} -> 1e-05; rollout.n {saved['rollout.n']!r} -> 4"
    )


def test_an_older_checkpoint_without_settings_resumes_with_a_note(tmp_path):
    out = tmp_path / "run"
    _checkpoint(out, 2, None)
    plan = plan_resume(_config(out, "algorithm.adv_estimator=rloo"))
    assert plan is not None and "records no settings" in plan.message


def test_changed_settings_counts_a_missing_key_and_skips_trainer_resume():
    saved = {"a.b": 1, "trainer.resume": "auto", "c": [1, 2]}
    current = {"a.b": 1, "trainer.resume": "none", "c": [1, 3], "d": True}
    assert changed_settings(saved, current) == {"c": ([1, 2], [1, 3]), "d": (None, True)}


def _cli_train(out: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlcli.cli", "train", str(RECIPE), f"trainer.output_dir={out}"]
        + ["trainer.total_steps=5", *overrides],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_cli_says_nothing_to_do_with_exit_0_and_refuses_with_exit_2(tmp_path):
    out = tmp_path / "run"
    _checkpoint(out, 5, run_settings(_config(out)))
    done = _cli_train(out)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "[rlcli] nothing to do:" in done.stdout
    refused = _cli_train(out, "algorithm.adv_estimator=rloo")
    assert refused.returncode == 2
    assert "algorithm.adv_estimator 'grpo' -> 'rloo'" in refused.stderr
    assert "Traceback" not in refused.stderr


def test_a_named_checkpoint_lists_differences_and_a_damaged_newest_is_passed_over(tmp_path):
    """trainer.resume=PATH from another run into a new folder (its model.path differs) resumes;
    with trainer.resume=auto a newest checkpoint whose files fail the manifest is passed over,
    as the resume itself passes it over."""
    first = tmp_path / "first"
    step = _checkpoint(first, 2, run_settings(_config(first, "model.path=/m1")))
    named = _config(tmp_path / "second", "model.path=/m2", f"trainer.resume={step}")
    plan = plan_resume(named)
    assert (
        plan is not None and not plan.nothing_to_do and "model.path '/m1' -> '/m2'" in plan.message
    )
    out = tmp_path / "run"
    _checkpoint(out, 1, run_settings(_config(out)))
    newest = _checkpoint(out, 5, run_settings(_config(out)))
    (newest / "shard.bin").write_bytes(b"x" * 100)
    write_manifest(newest)
    (newest / "shard.bin").write_bytes(b"x" * 10)  # truncated after the save
    plan = plan_resume(_config(out))
    assert plan is not None and plan.step == 1 and not plan.nothing_to_do
