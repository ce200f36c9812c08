"""R3: the HF engine's expert choices, replayed by the trainer (``model.moe_routing_replay=r3``).
``engine_routing_worker.py`` (one plain process) compares the engine's captured routing with
megatron-core's own on the same tokens, and the sampled tokens' log-probs with and without
replay; an ``rlcli train`` run carries it end to end (bad settings: test_train_moe.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.rlcli.test_train_e2e import REPO

WORKER = Path(__file__).with_name("engine_routing_worker.py")


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    from benchmarks.mismatch import make_tiny_qwen3_moe

    return make_tiny_qwen3_moe(tmp_path_factory.mktemp("qwen3_moe"))


def test_engine_routing_equals_the_trainers_and_replay_closes_the_gap(moe_dir, tmp_path):
    out = tmp_path / "result.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(moe_dir), str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    for case in result.values():
        # every token the engine read, and no other, carries its experts (12 samples, 2 layers)
        assert case["read_positions"] == case["expected_read_positions"], case
        assert case["routing_shape"][0] == 12 and case["routing_shape"][2:] == [2, 2], case
    same = result["float32"]  # the same numerics: the same experts, token by token
    assert same["routing_mismatch"] == 0 and same["replay_reports_mismatch"] == 0, same
    assert same["replay_diff_max"] < 1e-5 and same["free_diff_max"] < 1e-5, same
    moved = result["moved"]  # an engine whose routers disagree on some tokens
    assert moved["routing_mismatch"] > 0.05, moved
    assert abs(moved["replay_reports_mismatch"] - moved["routing_mismatch"]) < 0.05, moved
    assert moved["replay_diff_mean"] < moved["free_diff_mean"] / 3, moved
    assert moved["replay_diff_max"] < moved["free_diff_max"], moved
    # bf16's own flips depend on the CPU's bf16 kernels: its numbers are reported, not bounded
    assert result["bfloat16"]["replay_diff_max"] < 0.05, result["bfloat16"]


def run_train(moe_dir: Path, out: Path, *overrides: str) -> subprocess.CompletedProcess:
    from tests.rlcli.test_train_e2e import TINY

    tiny = [o for o in TINY if not o.startswith("model.")]
    return subprocess.run(
        [
            sys.executable, "-m", "rlcli.cli", "train", str(REPO / "recipes" / "quickstart.yaml"),
            *tiny, "model.build=false", f"model.path={moe_dir}", "rollout.engine=hf",
            f"trainer.output_dir={out}", "checkpoint.save_freq=0", *overrides,
        ],
        cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip


def test_grpo_with_r3_replays_the_engines_experts(moe_dir, tmp_path):
    proc = run_train(
        moe_dir, tmp_path / "run", "model.moe_routing_replay=r3", "trainer.total_steps=2"
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        # fp32 engine and trainer: no expert differs, and the log-probs agree
        assert record["rollout/routing_mismatch"] == 0, record
        assert record["rollout/logprob_diff_max"] < 1e-5, record
        assert 0 <= record["actor/routing_replay_changed"] < 1, record
