"""Qwen3.5's hybrid layers in training (``model.spec.architecture=qwen3_5``: three Gated
DeltaNet layers, then gated full attention): a GRPO run on the HF engine whose trainer and engine
agree after a weight sync, a checkpoint that exports to a folder transformers loads, and the
settings the DeltaNet layers cannot take, refused by `rlcli config validate` naming the key.
Conversion itself (logits vs transformers at TP1 / TP2 / PP2): tests/parallel/test_convert_parity.py."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from tests.rlcli.test_train_e2e import REPO, TINY

HYBRID = [
    *(o for o in TINY if not o.startswith("model.spec.num_layers")),
    "model.spec.architecture=qwen3_5",
    "model.spec.num_layers=4",
    "rollout.engine=hf",
]


def rlcli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlcli.cli", *args],
        cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


def test_grpo_on_qwen3_5_syncs_exactly_and_exports(tmp_path):
    out, model = tmp_path / "run", tmp_path / "model"
    recipe = str(REPO / "recipes" / "quickstart.yaml")
    proc = rlcli(
        "train", recipe, *HYBRID, f"model.path={model}", f"trainer.output_dir={out}",
        "trainer.total_steps=2", "checkpoint.save_freq=2",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        # fp32 engine and trainer, the engine's weights synced after step 1's update
        assert record["rollout/logprob_diff_max"] < 1e-5, record
        assert math.isfinite(record["actor/grad_norm"]) and record["actor/grad_norm"] > 0, record

    exported = tmp_path / "exported"
    proc = rlcli("export", str(out / "checkpoints" / "step_000002"), "--out", str(exported))
    assert proc.returncode == 0, proc.stderr[-3000:]
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    before, after = (
        load_file(model / "model.safetensors"),
        load_file(exported / "model.safetensors"),
    )
    assert set(after) == set(before)
    moved = {k for k in before if not torch.equal(after[k], before[k])}
    for part in ("linear_attn.in_proj_qkv", "linear_attn.conv1d", "linear_attn.A_log",
                 "self_attn.q_proj", "input_layernorm"):  # fmt: skip
        assert any(part in k for k in moved), (part, sorted(moved))
    loaded = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    assert loaded.config.model_type == "qwen3_5_text"
    assert loaded.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]


# vLLM's CPU engine runs the DeltaNet in bfloat16 only; the trainer stays in fp32, so the
# agreement is bf16's (docs/troubleshooting.md: about 1e-2), not the fp32 engine's 1e-5.
BF16_LOGPROB_MAX, BF16_LOGPROB_MEAN = 2e-2, 5e-3


def log_probs(model_dir, ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return torch.log_softmax(model(ids).logits, dim=-1)


@pytest.mark.vllm
def test_grpo_on_qwen3_5_with_vllm_rollouts_resumes_and_agrees_at_bf16(tmp_path):
    out, model = tmp_path / "run", tmp_path / "model"
    recipe = str(REPO / "recipes" / "quickstart.yaml")
    hybrid = [o for o in HYBRID if not o.startswith("rollout.engine")]
    engine = ["rollout.engine=vllm", "rollout.dtype=bfloat16", "actor.lr=2e-2"]
    for steps in (1, 2):  # step 2 runs in a second process, resumed from step 1's checkpoint
        proc = rlcli(
            "train", recipe, *hybrid, *engine, f"model.path={model}", f"trainer.output_dir={out}",
            f"trainer.total_steps={steps}",
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    assert [r["step"] for r in records] == [1, 2]
    for record in records:  # step 2 samples with the resumed weights, synced into vLLM
        assert record["rollout/logprob_diff_max"] < BF16_LOGPROB_MAX, record
        assert record["rollout/logprob_diff_mean"] < BF16_LOGPROB_MEAN, record

    # That agreement says the resumed weights reached the engine only if step 1's update moved
    # the model by much more than bf16's tolerance: step 1's checkpoint, exported to HF, against
    # the start, in transformers. The resumed run's own checkpoint exports and moved on again.
    ids = torch.arange(3, 40).unsqueeze(0)
    exported = {}
    for step in (1, 2):
        exported[step] = tmp_path / f"step{step}"
        checkpoint = out / "checkpoints" / f"step_{step:06d}"
        proc = rlcli("export", str(checkpoint), "--out", str(exported[step]))
        assert proc.returncode == 0, proc.stderr[-3000:]
    start, step1, step2 = (log_probs(m, ids) for m in (model, exported[1], exported[2]))
    assert (step1 - start).abs().max().item() > 10 * BF16_LOGPROB_MAX
    assert (step2 - step1).abs().max().item() > 10 * BF16_LOGPROB_MAX


@pytest.mark.parametrize(
    "override, key",
    [
        ("actor.pack_sequences=true", "actor.pack_sequences"),
        ("critic.pack_sequences=true", "critic.pack_sequences"),
        ("rollout.engine=vllm", "rollout.dtype=float32"),
    ],
)
def test_settings_the_delta_net_cannot_take_exit_2(override, key, tmp_path):
    if override == "rollout.engine=vllm" and torch.cuda.is_available():
        pytest.skip("vLLM's GPU engine runs Qwen3.5")
    recipe = str(REPO / "recipes" / "quickstart.yaml")
    proc = rlcli(
        "config", "validate", recipe, *HYBRID, f"model.path={tmp_path / 'model'}", override,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert key in proc.stderr + proc.stdout and "Traceback" not in proc.stderr, proc.stderr
