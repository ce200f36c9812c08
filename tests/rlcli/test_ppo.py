"""PPO with a Megatron critic: GAE in the loop, the value loss, a TP2 run that saves and resumes,
and the critic exported as an HF model.

The loop checks run ``critic_worker.py`` under torchrun (DP2); the run is ``rlcli train`` under
torchrun (TP2, the critic in the actor's layout) with the HF engine.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.parallel.dist_utils import make_tiny_hf_model, run_torchrun
from tests.rlcli.test_train_e2e import REPO, check_step_metrics, records, train

WORKER = Path(__file__).with_name("critic_worker.py")

PPO = [
    "algorithm.adv_estimator=gae",
    "algorithm.gamma=0.95",
    "algorithm.lam=0.9",
    "algorithm.use_kl_in_reward=true",
    "algorithm.kl_ctrl.type=adaptive",
    "critic.lr=1e-3",
    "critic.micro_batch_size=5",
    "critic.ppo_mini_batch_size=2",
    "trainer.critic_warmup=1",
    "rollout.engine=hf",
    "parallel.tp=2",
]

CRITIC_METRICS = [
    "critic/vf_loss",
    "critic/vf_clipfrac",
    "critic/vpred_mean",
    "critic/values_explained_variance",
    "critic/returns_mean",
    "critic/grad_norm",
    "critic/lr",
    "timing/values",
    "timing/update_critic",
]

# Wall-clock and memory readings differ between two runs of the same computation.
NOT_REPRODUCIBLE = ("timing/", "perf/", "system/", "sync/gbps", "offload/", "onload/")


@pytest.mark.dist
def test_gae_in_the_loop_and_the_value_loss_falls(tmp_path):
    model = make_tiny_hf_model(tmp_path / "model")
    out = tmp_path / "loop.json"
    run_torchrun(WORKER, 2, "loop", str(model), str(out), timeout_s=300)
    result = json.loads(out.read_text())
    # The batch's values are the critic's outputs at the positions that predict each token.
    assert result["worst"]["values_alone"] < 1e-5, result["worst"]
    # KL-in-reward rewards, GAE advantages (whitened over both DP ranks) and returns equal the
    # plain-python recomputation.
    for key in ("rewards", "advantages", "returns"):
        assert result["worst"][key] < 1e-5, (key, result["worst"])
    losses = result["losses"]
    assert losses[0] == pytest.approx(result["expected_first_loss"], rel=1e-5)
    assert all(b < a for a, b in zip(losses[:3], losses[1:4], strict=True)), losses
    assert losses[-1] < 0.95 * losses[0], losses


@pytest.fixture(scope="module")
def ppo_run(tmp_path_factory) -> Path:
    """Three PPO steps at TP2 (step 1 critic only), a checkpoint after each."""
    out = tmp_path_factory.mktemp("ppo") / "run"
    train(out, *PPO, "trainer.total_steps=3")
    return out


@pytest.mark.dist
def test_ppo_tp2_resume_continues_as_uninterrupted(ppo_run, tmp_path):
    steps = records(ppo_run)
    assert [r["step"] for r in steps] == [1, 2, 3]
    for record in steps:
        if record["step"] > 1:  # step 1 is the critic warmup: no actor metrics
            check_step_metrics(record)
        for key in CRITIC_METRICS:
            assert math.isfinite(record[key]), (key, record)
    assert steps[0]["actor/skipped_update"] == 1.0 and "actor/pg_loss" not in steps[0]
    assert "actor/pg_loss" in steps[1] and "actor/skipped_update" not in steps[1]
    step2 = ppo_run / "checkpoints" / "step_000002"
    assert (step2 / "critic" / "model" / "metadata.json").is_file()
    assert (step2 / "critic" / "hf" / "config.json").is_file()

    # A new run resumes from step 2 (model, optimizer and critic) and redoes step 3.
    resumed_out = tmp_path / "resumed"
    train(resumed_out, *PPO, "trainer.total_steps=3", f"trainer.resume={step2}")
    resumed = records(resumed_out)
    assert [r["step"] for r in resumed] == [3]
    expected = {k: v for k, v in steps[2].items() if not k.startswith(NOT_REPRODUCIBLE)}
    got = {k: v for k, v in resumed[0].items() if not k.startswith(NOT_REPRODUCIBLE)}
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key


@pytest.mark.dist
def test_export_critic_loads_in_transformers_with_the_same_values(ppo_run, tmp_path):
    step = ppo_run / "checkpoints" / "step_000003"
    exported = tmp_path / "critic_hf"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlcli.cli",
            "export",
            str(step),
            "--out",
            str(exported),
            "--critic",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForTokenClassification"]
    out = tmp_path / "values.json"
    run_torchrun(WORKER, 1, "values", str(step), str(exported), str(out), timeout_s=300)
    result = json.loads(out.read_text())
    assert result["class"] == "Qwen2ForTokenClassification"
    assert result["value_scale"] > 1e-3  # a real comparison, not of zeros
    assert result["max_abs_diff"] < 1e-4, result


def test_export_critic_of_a_run_without_one_is_a_user_error(tmp_path):
    step = tmp_path / "step_000001"
    step.mkdir()
    (step / "COMPLETE").write_text("{}")
    proc = subprocess.run(
        [sys.executable, "-m", "rlcli.cli", "export", str(step), "--out", str(tmp_path / "o")]
        + ["--critic"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "has no critic" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(("recipe", "world_size"), [("ppo_quickstart", 1), ("ppo_qwen7b", 16)])
def test_ppo_recipes_load_at_their_world_size(recipe, world_size):
    from rlcli.validation.loader import load_config
    from rlcli.validation.validate import validate

    cfg = load_config(REPO / "recipes" / f"{recipe}.yaml")
    validate(cfg, world_size=world_size)
    assert cfg.algorithm.uses_critic and cfg.trainer.critic_warmup > 0
