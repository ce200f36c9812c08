"""Vision-language RL end to end (recipes/vlm_quickstart.yaml, shortened): a tiny Qwen2.5-VL built
with its processor, pictures drawn at run time, an SFT warm start on rows with images, GRPO with
rollouts on vLLM (colocated). Checks: the trainer's and the engine's log-probs of every sampled
token agree, also after a resume in a second process, with the vision tower trained too; the
checkpoint exports as a Qwen2.5-VL folder that transformers loads (language model and tower
trained) and that `rlcli eval`
scores exactly as the run scored its final weights; the settings not built for a
vision-language policy are refused naming their keys. The numerics of the model itself (logits
vs transformers with images, TP1 / TP2): tests/parallel/test_vision_language.py."""

from __future__ import annotations

import json

import pytest
import torch

from tests.rlcli.test_train_e2e import REPO
from tests.rlcli.test_train_hybrid import rlcli

pytest.importorskip("torchvision", reason="Qwen2.5-VL's processor needs torchvision's transforms")

RECIPE = str(REPO / "recipes" / "vlm_quickstart.yaml")
SHORT = [
    "sft.steps=40", "sft.batch_size=8", "data.train_batch_size=4", "rollout.n=8",
    "trainer.val_freq=0", "checkpoint.save_freq=1",
    # the tower trains too: its weights must reach the engine at every sync (and its image
    # caches be dropped), and the checkpoint must carry it and its optimizer state
    "model.freeze_vision_tower=false",
]  # fmt: skip


@pytest.mark.vllm
def test_grpo_with_images_on_vllm_agrees_resumes_and_exports(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    out = tmp_path / "run"
    for steps in (1, 2):  # step 2 in a second process, resumed from step 1's checkpoint
        proc = rlcli("train", RECIPE, *SHORT, f"trainer.output_dir={out}",
                     f"trainer.total_steps={steps}")  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "resumed" in proc.stdout, proc.stdout[-2000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    assert [r["step"] for r in records if "rollout/logprob_diff_max" in r] == [1, 2]
    for record in records:
        if "rollout/logprob_diff_max" in record:  # fp32 engine and trainer, images in both
            assert record["rollout/logprob_diff_max"] < 1e-3, record
    final = [r for r in records if r["step"] == 2 and "val/reward/accuracy" in r][-1]

    exported = tmp_path / "exported"
    proc = rlcli("export", str(out / "checkpoints" / "step_000002"), "--out", str(exported))
    assert proc.returncode == 0, proc.stderr[-3000:]
    start = load_file(out / "sft_model" / "model.safetensors")
    after = load_file(exported / "model.safetensors")
    assert set(after) == set(start)
    moved = {name for name in start if not torch.equal(after[name], start[name])}
    assert any(name.startswith("visual.blocks.") for name in moved), sorted(moved)
    assert any(name.startswith("visual.merger.") for name in moved), sorted(moved)
    assert any(".self_attn." in name for name in moved) and any(".mlp." in name for name in moved)
    model = AutoModelForImageTextToText.from_pretrained(exported)
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"

    # The run's last validation used its final weights (synced into vLLM after step 2's
    # update); the exported folder, processor included, scores the same prompts identically.
    proc = rlcli("eval", RECIPE, *SHORT, f"trainer.output_dir={out}", "--model", str(exported))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    said = f"val/reward/accuracy {final['val/reward/accuracy']:.4g}"
    assert said in proc.stdout, (said, proc.stdout[-2000:])


@pytest.mark.parametrize(
    "override, key",
    [
        ("algorithm.adv_estimator=gae", "algorithm.adv_estimator=gae"),
        ("rollout.multi_turn.enable=true", "rollout.multi_turn.enable"),
        ("parallel.sequence_parallel=true", "parallel.sequence_parallel"),
        ("model.freeze_vision_tower=false parallel.pp=2", "model.freeze_vision_tower=false"),
        ("actor.lora.enable=true", "actor.lora.enable"),
        ("actor.pack_sequences=true", "actor.pack_sequences"),
    ],
)
def test_what_is_not_built_for_a_vision_language_policy_is_refused(tmp_path, override, key):
    needed = {  # what the setting needs besides, so that the check reached is this one
        "rollout.multi_turn.enable": "rollout.multi_turn.tool_config=recipes/tools/calculator.yaml",
    }.get(key, "trainer.total_steps=1")
    proc = rlcli(
        "config", "validate", RECIPE, *override.split(), needed, f"trainer.output_dir={tmp_path}"
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert key in proc.stderr and "vision-language" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_tower_to_train_on_a_text_model_is_refused(tmp_path):
    recipe = str(REPO / "recipes" / "quickstart.yaml")
    proc = rlcli("config", "validate", recipe, "model.freeze_vision_tower=false",
                 f"trainer.output_dir={tmp_path}")  # fmt: skip
    assert proc.returncode == 2 and "no vision tower" in proc.stderr, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
