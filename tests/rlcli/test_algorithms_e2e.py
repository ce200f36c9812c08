"""Every algorithm name runs through the real trainer step with only config changes."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.rlcli.test_train_e2e import REPO, TINY

WORKER = Path(__file__).with_name("algorithms_worker.py")


def test_every_algorithm_runs_a_training_step(tmp_path):
    out = tmp_path / "metrics.json"
    overrides = [*TINY, "rollout.engine=hf", f"trainer.output_dir={tmp_path / 'run'}"]
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [
            sys.executable,
            str(WORKER),
            str(REPO / "recipes" / "quickstart.yaml"),
            str(out),
            *overrides,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    results = json.loads(out.read_text())
    from tests.rlcli.algorithms_worker import (
        ENGINE_TEACHER,
        SAME_TEACHER,
        TOP_K_ENGINE_TEACHER,
        TOP_K_SAME_TEACHER,
        VARIANTS,
    )

    assert set(results) == set(VARIANTS)
    for name, metrics in results.items():
        for key, value in metrics.items():
            assert math.isfinite(value), (name, key, value)
        assert "timing/step" in metrics and "perf/tokens_per_s" in metrics, (name, metrics)
        if name == "dapo" and metrics["dapo/kept_groups_ratio"] == 0:
            # A random model may give no group whose reward varies: then nothing is trained on,
            # and the step says so.
            assert metrics["actor/skipped_update"] == 1.0, metrics
            assert "actor/pg_loss" not in metrics and "timing/update" not in metrics, metrics
            continue
        assert "actor/pg_loss" in metrics and "actor/grad_norm" in metrics, (name, metrics)
        assert metrics["rollout/logprob_diff_max"] < 1e-3, (name, metrics)
    assert "actor/kl_loss" in results["kl_loss"] and "actor/entropy" in results["kl_loss"]
    assert "actor/kl_loss" not in results["grpo"]
    assert "reward_kl_penalty" in results["kl_in_reward"]
    assert "dapo/kept_groups_ratio" in results["dapo"] and "dapo/gen_batches" in results["dapo"]
    assert results["dapo"]["dapo/gen_batches"] >= 1
    # The old-log-prob pass runs only when the update is not on-policy (two epochs here); the
    # engine's log-probs as old log-probs still log the mismatch (from the update's forward).
    assert "timing/old_log_prob" in results["grpo"]  # two mini-batches
    assert "timing/old_log_prob" not in results["on_policy"]
    assert "timing/old_log_prob" not in results["engine_old_log_probs"]
    assert "rollout/logprob_diff_mean" in results["engine_old_log_probs"]
    assert "timing/old_log_prob" in results["token_budget_two_epochs"]
    assert results["token_budget_two_epochs"]["actor/optimizer_steps"] == 2.0
    # The trainer-vs-engine mismatch, every step; fp32 on CPU: the two agree to rounding, so the
    # rollout corrections weigh every token about 1 and mask none.
    for name in ("grpo", "on_policy", "seq_is_geo", "token_mis"):
        metrics = results[name]
        assert abs(metrics["rollout/mismatch_kl_k1"]) < 1e-4, (name, metrics)
        assert 0 <= metrics["rollout/mismatch_kl_k3"] < 1e-6, (name, metrics)
        assert metrics["rollout/mismatch_ppl_ratio"] == pytest.approx(1, abs=1e-3)
    for name in ("seq_is_geo", "token_mis"):
        assert results[name]["actor/is_weight_mean"] == pytest.approx(1, abs=1e-3)
    assert results["token_mis"]["actor/is_masked_token_frac"] == 0.0
    # On-policy distillation: a teacher equal to the student gives no signal and no update (the
    # start weights exactly: zero gradients make a zero Adam step); once the actor has moved, the
    # divergence is measured and the task reward mixes in.
    same = results[SAME_TEACHER]
    assert same["distill/reverse_kl"] == 0.0 and same["distill/reverse_kl_k3"] == 0.0, same
    assert same["critic/advantages_abs_max"] == 0.0 and same["actor/grad_norm"] == 0.0, same
    assert same["check/max_weight_change"] == 0.0, same
    assert "timing/teacher" in same and "timing/old_log_prob" in same
    # The same weights on the HF engine, scored before the samples are shared out: equal to
    # Megatron's log-probs to rounding.
    engine = results[ENGINE_TEACHER]
    assert abs(engine["distill/reverse_kl"]) < 1e-5 and engine["distill/reverse_kl_k3"] < 1e-8
    assert "timing/teacher" in engine
    moved = results["distill"]
    assert moved["distill/reverse_kl_k3"] > 0 and moved["actor/grad_norm"] > 0, moved
    assert moved["check/max_weight_change"] > 0, moved
    quarters = [moved[f"distill/reverse_kl_q{q}"] for q in (1, 2, 3, 4)]
    assert all(math.isfinite(v) for v in quarters) and max(quarters) > 0, moved
    assert all(same[f"distill/reverse_kl_q{q}"] == 0.0 for q in (1, 2, 3, 4)), same
    # The top-k loss (the teacher's 8 likeliest tokens per position, a loss of the update's own
    # forward): with the teacher equal to the student only the two passes' float32 rounding is
    # left of it (Adam's normalised step still moves the weights a little: lr x g / (|g| + eps)
    # with g near eps); once the actor has moved, a loss and a gradient; no advantage either way
    # (reward_weight 0), the sampled tokens' reverse KL reported as before.
    # The same on the HF engine teacher (its top 8 from transformers, scored before the samples
    # are shared out).
    top_same, top_moved = results[TOP_K_SAME_TEACHER], results["distill_topk"]
    for name in (TOP_K_SAME_TEACHER, TOP_K_ENGINE_TEACHER):
        metrics = results[name]
        assert abs(metrics["actor/distill_loss"]) < 1e-7 and metrics["actor/grad_norm"] < 1e-6
        assert abs(metrics["distill/reverse_kl"]) < 1e-5, (name, metrics)
        assert "timing/teacher" in metrics
    assert top_moved["actor/distill_loss"] > 1e-3 and top_moved["actor/grad_norm"] > 1e-2
    assert top_same["check/max_weight_change"] < 0.1 * top_moved["check/max_weight_change"]
    assert top_moved["critic/advantages_abs_max"] == 0.0 and top_moved["distill/reverse_kl_k3"] > 0
    assert "actor/distill_loss" not in moved
    assert results["grpo"]["check/max_weight_change"] > 0
    assert not any(key.startswith("distill/") for key in results["grpo"])
    # system/* every step: memory positive, utilisation a percentage
    for metrics in results.values():
        assert metrics["system/host_rss_gb"] > 0 and metrics["system/host_available_gb"] > 0
        assert 0 <= metrics["system/cpu_util_percent"] <= 100
