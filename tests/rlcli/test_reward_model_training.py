"""`rlcli rm` end to end on the quickstart task: a small Qwen2 built locally (tokenizer trained
on the task's text, random weights) is trained as a reward model on the synthetic preference
pairs (the correct answer preferred); its held-out pairwise accuracy rises, the exported folder
loads with AutoModelForSequenceClassification and scores the held-out pairs as the run reported,
checkpoints are written, and a longer run resumes from them: its newest one damaged, from the one
before, saying so (as ``rlcli train`` does). Bad preference rows exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlcli.errors import USER_ERROR_EXIT_CODE
from tests.rlcli.arith_model import build_arith_model

REPO = Path(__file__).resolve().parents[2]
SPEC = {"hidden_size": 128, "num_layers": 2, "num_heads": 2, "num_kv_heads": 2}


def rlcli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlcli.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def quickstart_model(tmp_path_factory) -> Path:
    return build_arith_model(
        tmp_path_factory.mktemp("rm_quickstart"), **SPEC, intermediate_size=256
    )


def _recipe(tmp_path: Path, model: Path, **rm: object) -> Path:
    settings = {"synthetic": "arith", "batch_size": 32, "micro_batch_size": 32, "lr": 1e-3, **rm}
    recipe = {
        "model": {"path": str(model)},
        "rm": settings,
        "trainer": {"output_dir": str(tmp_path / "run")},
    }
    path = tmp_path / "rm.json"  # JSON is YAML
    path.write_text(json.dumps(recipe))
    return path


def _hf_accuracy(out_dir: Path, val_file: Path) -> float:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from parallel.preference_pairs import pad_sequences
    from rlcli.data.preferences import read_preference_rows, tokenize_preferences

    model, info = AutoModelForSequenceClassification.from_pretrained(
        out_dir, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    pairs, _ = tokenize_preferences(read_preference_rows([str(val_file)]), tokenizer)
    ids, mask = pad_sequences(pairs.chosen + pairs.rejected, model.config.pad_token_id)
    with torch.no_grad():
        scores = model(input_ids=ids, attention_mask=mask).logits[:, 0]
    chosen, rejected = scores[: len(pairs)], scores[len(pairs) :]
    return ((chosen > rejected).float() + 0.5 * (chosen == rejected).float()).mean().item()


def test_rm_learns_exports_checkpoints_and_resumes(quickstart_model, tmp_path):
    recipe = _recipe(tmp_path, quickstart_model, steps=30, save_freq=15)
    proc = rlcli("rm", str(recipe))
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    run = tmp_path / "run"
    report = json.loads((run / "reward_model_report.json").read_text())
    print({k: v for k, v in report.items() if k != "history"})
    before, after = report["val_accuracy_before"], report["val_accuracy_after"]
    assert report["val_pairs"] == 200 and len(report["history"]) == 30
    # From random weights, 30 steps learn what a rejected answer's form gives away (a malformed
    # answer: a fifth of them), not yet the sums (held-out 0.44 -> 0.61 measured)
    assert after >= 0.55 and after >= before + 0.1, report
    # the exported folder, read by transformers alone, agrees with what the run measured
    hf_accuracy = _hf_accuracy(run / "reward_model", run / "data" / "rm_val.jsonl")
    assert abs(hf_accuracy - after) <= 1 / 200, (hf_accuracy, after)
    checkpoints = sorted(p.name for p in (run / "rm_checkpoints").glob("step_*"))
    assert checkpoints == ["step_000015", "step_000030"], checkpoints

    # The newest checkpoint damaged after its commit: trainer.resume=auto takes the one before.
    damaged = run / "rm_checkpoints" / "step_000030"
    shard = sorted((damaged / "model").glob("*.distcp"))[0]
    with open(shard, "r+b") as handle:
        handle.truncate(100)
    longer = rlcli("rm", str(recipe), "rm.steps=35")
    assert longer.returncode == 0, (longer.stdout + longer.stderr)[-4000:]
    assert f"trainer.resume=auto: skipping damaged checkpoint {damaged}" in longer.stdout
    previous = run / "rm_checkpoints" / "step_000015"
    assert f"resuming from {previous}, the newest intact checkpoint" in longer.stdout
    assert f"resumed the reward model from {previous} (step 15)" in longer.stdout
    resumed = json.loads((run / "reward_model_report.json").read_text())
    assert len(resumed["history"]) == 35 and resumed["val_accuracy_before"] == before
    # steps 16-30 done again from step 15's weights, optimizer and RNGs: the same numbers
    assert resumed["history"][:30] == report["history"]


def test_rows_without_rejected_exit_2_naming_file_and_row(quickstart_model, tmp_path):
    rows = tmp_path / "prefs.jsonl"
    rows.write_text(
        json.dumps({"prompt": "q", "chosen": "a", "rejected": "b"})
        + "\n"
        + json.dumps({"prompt": "q", "chosen": "a"})
        + "\n"
    )
    recipe = _recipe(tmp_path, quickstart_model, synthetic=None, train_files=[str(rows)])
    proc = rlcli("rm", str(recipe))
    output = proc.stdout + proc.stderr
    assert proc.returncode == USER_ERROR_EXIT_CODE, output[-3000:]
    assert f"{rows}, line 2" in output and "'rejected'" in output, output[-3000:]
    assert "Traceback" not in output


def test_rm_settings_are_checked_before_any_work(quickstart_model, tmp_path):
    recipe = _recipe(tmp_path, quickstart_model, batch_size=3)
    proc = rlcli("rm", str(recipe), "--nproc", "2")
    assert proc.returncode == USER_ERROR_EXIT_CODE
    assert "rm.batch_size=3 must divide evenly over the 2 data-parallel" in proc.stderr
    proc = rlcli("rm", str(recipe), "rm.synthetic=gsm8k")
    assert proc.returncode == USER_ERROR_EXIT_CODE and "rm.synthetic" in proc.stderr
