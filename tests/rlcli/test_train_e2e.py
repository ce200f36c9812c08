"""End to end: `rlcli train` under torchrun (TP2, PP2), vLLM and HF engines, checkpoint + resume.

A tiny Qwen2 is built locally; rewards come from a user function loaded by file path. Each run
checks that the metrics exist and are finite, that the trainer and the engine agree on the
sampled tokens' log-probs, and that a resumed run continues at the next step with the loader
where the interrupted run left it.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.parallel.dist_utils import run_process_group

REPO = Path(__file__).resolve().parents[2]
REWARD = Path(__file__).with_name("length_reward.py")

TINY = [
    "data.synthetic=arith",
    "data.train_batch_size=4",
    "data.max_prompt_length=32",
    "model.build=true",
    "model.spec.hidden_size=128",  # head_dim 64: vLLM-CPU attention has no kernel for 16
    "model.spec.num_layers=2",
    "model.spec.num_heads=2",
    "model.spec.num_kv_heads=2",
    "model.spec.intermediate_size=128",
    "rollout.n=4",
    "rollout.max_tokens=8",
    "rollout.kv_cache_gb=0.05",
    "actor.lr=1e-3",
    "actor.micro_batch_size=8",
    "actor.ppo_mini_batch_size=2",
    "sft.steps=0",
    "algorithm.dynamic_sampling.enabled=false",
    f"reward.fn={REWARD}:compute_score",
    "trainer.val_freq=0",
    "trainer.val_before_train=false",
    "logging.backends=[jsonl]",
    "checkpoint.save_freq=1",
]

REQUIRED = [
    "reward/score_mean",
    "reward/accuracy",
    "response_length/mean",
    "actor/pg_loss",
    "actor/grad_norm",
    "actor/lr",
    "timing/gen",
    "timing/old_log_prob",
    "timing/update",
    "timing/sync",
    "timing/step",
    "perf/tokens_per_s",
    "sync/gbps",
    "rollout/logprob_diff_mean",
    "rollout/logprob_diff_max",
    "data/position",
]


def train(out: Path, *overrides: str, nproc: int = 2, via_cli: bool = False) -> None:
    """Run under torchrun, or let ``rlcli train --nproc`` start torchrun itself (``via_cli``)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    launcher = ["--nproc", str(nproc)] if via_cli else []
    torchrun = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd = [
        sys.executable,
        *([] if via_cli else torchrun),
        "-m",
        "rlcli.cli",
        "train",
        *launcher,
        str(REPO / "recipes" / "quickstart.yaml"),
        *TINY,
        f"trainer.output_dir={out}",
        *overrides,
    ]
    returncode, output = run_process_group(cmd, env=env, cwd=REPO, timeout_s=900)
    assert returncode == 0, output[-8000:]


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def check_step_metrics(record: dict) -> None:
    for key in REQUIRED:
        assert key in record, f"{key} missing from step {record['step']}: {sorted(record)}"
        assert math.isfinite(record[key]), (key, record[key])
    assert record["rollout/logprob_diff_max"] < 1e-3, record["rollout/logprob_diff_max"]


@pytest.fixture(scope="module")
def tp2_run(tmp_path_factory) -> Path:
    """A 2-step TP2 run on vLLM, saving every step: the resume test continues it, the export test
    exports its step 2 (kept: checkpoint.keep_last is 2)."""
    out = tmp_path_factory.mktemp("tp2") / "run"
    train(out, "parallel.tp=2", "rollout.engine=vllm", "trainer.total_steps=2")
    return out


@pytest.mark.dist
@pytest.mark.vllm
def test_tp2_vllm_train_checkpoint_and_resume(tp2_run):
    out = tp2_run
    first = records(out)
    assert [r["step"] for r in first] == [1, 2]
    for record in first:
        check_step_metrics(record)
    state = json.loads((out / "checkpoints" / "step_000002" / "trainer_state.json").read_text())
    assert state["step"] == 2 and state["loader"]["position"] == 2 * 4

    train(out, "parallel.tp=2", "rollout.engine=vllm", "trainer.total_steps=3")
    resumed = records(out)
    assert [r["step"] for r in resumed] == [1, 2, 3]  # each step logged once
    check_step_metrics(resumed[-1])
    # The resumed step drew the batch after the checkpoint's (positions count samples).
    assert resumed[-1]["data/position"] == 3 * 4
    assert resumed[:2] == first


@pytest.mark.dist
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_pp2_hf_engine(tmp_path, packed):
    out = tmp_path / "run"
    train(  # through `rlcli train --nproc 2`, which starts torchrun itself
        out,
        "parallel.pp=2",
        "rollout.engine=hf",
        "trainer.total_steps=2",
        "checkpoint.save_freq=0",
        "actor.micro_batch_size=6",  # 16 samples -> 6, 6, 4: pipeline stages need equal sizes
        # packed: micro-batches of whole sequences up to 6 x the longest, each one row
        *(["actor.pack_sequences=true"] if packed else []),
        via_cli=True,
    )
    steps = records(out)
    assert [r["step"] for r in steps] == [1, 2]
    for record in steps:
        check_step_metrics(record)


@pytest.mark.dist
@pytest.mark.vllm
def test_export_checkpoint_as_hf_model(tp2_run, tmp_path):
    """A TP2 training checkpoint exports (at TP1) to a HF model that transformers loads."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from rlcli.run.checkpoints import CheckpointManager

    out = tp2_run
    exported = tmp_path / "exported"

    def rlcli(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "rlcli.cli", *args]
        return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)

    proc = rlcli("export", str(out), "--out", str(exported))  # the run's folder: its newest
    assert proc.returncode == 0, proc.stderr[-3000:]
    newest = CheckpointManager(out / "checkpoints", rank=0, world_size=1).latest_dir()
    said = f"exporting the newest checkpoint of {out / 'checkpoints'}: {newest.name}"
    assert said in proc.stdout
    umask = os.umask(0)
    os.umask(umask)
    assert (exported / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask
    again = rlcli("export", str(newest), "--out", str(exported))
    assert again.returncode == 2 and "--overwrite" in again.stderr
    verified = rlcli("checkpoint", "verify", str(out))  # a run's folder, as `rlcli plot` takes
    assert verified.returncode == 0 and " intact" in verified.stdout, verified.stdout
    before = load_file(out / "model" / "model.safetensors")
    after = load_file(exported / "model.safetensors")
    assert set(after) == set(before)
    assert all(after[k].shape == before[k].shape for k in before)
    assert any(not torch.equal(after[k], before[k]) for k in before)  # training moved weights
    model = AutoModelForCausalLM.from_pretrained(exported)
    logits = model(torch.tensor([[1, 2, 3]])).logits
    assert torch.isfinite(logits).all()
