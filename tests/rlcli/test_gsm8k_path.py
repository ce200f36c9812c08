"""The GSM8K path end to end: `rlcli data gsm8k` on a file named as the README's example writes the
files recipes/grpo_qwen7b.yaml reads, and that recipe, with only its model and sizes shrunk to a
tiny CPU run, trains a step on them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.rlcli.arith_model import build_arith_model

REPO = Path(__file__).resolve().parents[2]
RAW = [
    {"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3 + 4 = 7\n#### 7"},
    {"question": "Ann has 2 pens and loses 1. How many?", "answer": "2 - 1 = 1\n#### 1"},
]
# recipes/grpo_qwen7b.yaml's 16-GPU shapes, shrunk; its data.* settings are left as they are.
TINY_RUN = [
    "parallel.tp=1",
    "parallel.use_distributed_optimizer=false",
    "model.dtype=float32",
    "rollout.engine=hf",
    "rollout.tp=1",
    "rollout.n=2",
    "rollout.max_tokens=4",
    "data.train_batch_size=2",
    "actor.ppo_mini_batch_size=2",
    "actor.micro_batch_size=4",
    "trainer.total_steps=1",
    "trainer.val_freq=0",
    "trainer.val_before_train=false",
    "checkpoint.save_freq=0",
    "logging.backends=[jsonl]",
]


def _rlcli(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlcli.cli", *args],
        cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=900,
    )


def test_gsm8k_data_trains_with_the_gsm8k_recipe(tmp_path):
    for split in ("train", "test"):
        raw = tmp_path / f"gsm8k_{split}.jsonl"
        raw.write_text("".join(json.dumps(row) + "\n" for row in RAW))
        made = _rlcli(tmp_path, "data", "gsm8k", "--input", raw.name, "--output", "data/gsm8k")
        assert made.returncode == 0, made.stderr
    model = build_arith_model(
        tmp_path / "tiny", hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=2,
        intermediate_size=64,
    )  # fmt: skip
    out = tmp_path / "outputs" / "run"
    recipe = REPO / "recipes" / "grpo_qwen7b.yaml"
    run = _rlcli(
        tmp_path, "train", str(recipe), f"model.path={model}", f"trainer.output_dir={out}",
        *TINY_RUN,
    )  # fmt: skip
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1]
    assert "reward/score_mean" in rows[0]  # the gsm8k reward scored the step's samples
