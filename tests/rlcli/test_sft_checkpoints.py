"""The SFT warm start's checkpoints (``sft.save_freq``), saved and resumed by the helper RL and
reward-model training use: a warm start interrupted after its step-2 checkpoint (its later
checkpoint and its model gone) resumes from step 2 and writes the same model, bit for bit, as the
run that was not interrupted."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from safetensors.torch import load_file

from tests.rlcli.test_train_e2e import REPO, TINY


def rlcli_sft(out: Path) -> str:
    overrides = [o for o in TINY if not o.startswith("sft.")] + [
        "sft.steps=4",
        "sft.save_freq=2",
        "sft.batch_size=8",
        "sft.micro_batch_size=8",
        f"trainer.output_dir={out}",
    ]
    return rlcli("sft", str(REPO / "recipes" / "quickstart.yaml"), *overrides)


def rlcli(*args: str) -> str:
    """The command's output; it must succeed."""
    proc = subprocess.run(
        [sys.executable, "-m", "rlcli.cli", *args],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    return output


def weights(folder: Path) -> dict:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_an_interrupted_warm_start_resumes_from_its_checkpoint(tmp_path):
    out = tmp_path / "run"
    rlcli_sft(out)
    checkpoints = out / "sft_checkpoints"
    assert sorted(p.name for p in checkpoints.glob("step_*")) == ["step_000002", "step_000004"]
    whole = weights(out / "sft_model")
    shutil.rmtree(out / "sft_model")
    shutil.rmtree(checkpoints / "step_000004")  # as if the run died during step 3 or 4
    output = rlcli_sft(out)
    assert f"resumed the SFT warm start from {checkpoints / 'step_000002'} (step 2)" in output
    resumed = weights(out / "sft_model")
    assert resumed.keys() == whole.keys()
    assert all(resumed[k].equal(whole[k]) for k in whole)


def test_the_warm_start_is_reused_only_with_the_settings_it_was_made_with(tmp_path):
    """``rlcli sft`` records the settings that decide its model; ``rlcli train`` reuses that model
    only when they match, and trains it again (saying what changed) when they do not."""
    from rlcli.run.resume_plan import run_settings, warm_start_changes
    from rlcli.validation.loader import load_config

    out = tmp_path / "run"
    rlcli_sft(out)
    given = [o for o in TINY if not o.startswith("sft.")] + [
        "sft.save_freq=2",
        "sft.batch_size=8",
        "sft.micro_batch_size=8",
        f"trainer.output_dir={out}",
    ]
    recipe = REPO / "recipes" / "quickstart.yaml"
    same = run_settings(load_config(recipe, [*given, "sft.steps=4"]))
    assert warm_start_changes(out / "sft_model", same) is None
    before = weights(out / "sft_model")
    output = rlcli(
        "train", str(recipe), *given, "sft.steps=2", "trainer.total_steps=1", "rollout.engine=hf"
    )
    assert f"training {out / 'sft_model'} again, from scratch: sft.steps 4 -> 2" in output
    assert "resumed the SFT warm start" not in output  # not from the old settings' checkpoints
    after = weights(out / "sft_model")
    assert any(not after[k].equal(before[k]) for k in before)  # a new model, from 2 steps
