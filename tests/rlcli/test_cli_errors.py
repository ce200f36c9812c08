"""`rlcli` on wrong command lines and wrong config values: exit code 2, a short message naming the
command, option, key or file, and never a traceback. Each case fails before any model or data is
loaded, so each is one quick subprocess, run as a user would run it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = str(REPO / "recipes" / "quickstart.yaml")


def rlcli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlcli.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def assert_exit_2(proc: subprocess.CompletedProcess, *needles: str) -> None:
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, (proc.returncode, output[-3000:])
    assert "Traceback" not in output, output[-3000:]
    for needle in needles:
        assert needle in output, (needle, output[-3000:])


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["foo"], ["No such command 'foo'", "Usage: rlcli"]),
        (["train"], ["Missing argument", "Usage: rlcli train"]),
        (["train", QUICKSTART, "--bogus"], ["No such option: --bogus", "Usage: rlcli train"]),
    ],
)
def test_usage_errors_print_usage(args, needles):
    assert_exit_2(rlcli(*args), *needles)


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        (["parallel.tp=2"], ["parallel.tp=2", "--nproc 2"]),
        (["reward.kwargs=[strict]"], ["reward.kwargs must be a mapping", "['strict']"]),
        (
            ["trainer.total_steps=600", "actor.lr_warmup_steps=600"],
            ["actor.lr_warmup_steps=600", "trainer.total_steps=600"],
        ),
        (
            ["algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.horizon=0"],
            ["algorithm.kl_ctrl.horizon=0", "adaptive"],
        ),
        (["rollout.val_n=0"], ["rollout.val_n must be >= 1"]),
        # a token budget below the longest sequence (quickstart: 32 + 12 tokens)
        (
            ["actor.max_tokens_per_micro_batch=1"],
            ["actor.max_tokens_per_micro_batch=1", "rollout.max_tokens = 44"],
        ),
        (["actor.max_tokens_per_forward=43"], ["actor.max_tokens_per_forward=43", "at least 44"]),
        (
            ["algorithm.adv_estimator=gae", "critic.max_tokens_per_micro_batch=8"],
            ["critic.max_tokens_per_micro_batch=8", "at least 44"],
        ),
        (
            [
                "algorithm.adv_estimator=gae",
                "critic.pack_sequences=true",
                "model.attention_backend=local",
            ],
            ["critic.pack_sequences=true", "model.attention_backend=sdpa"],
        ),
        (["model.attention_backend=flash"], ["model.attention_backend", "'flash'", "sdpa"]),
        (["sft.micro_batch_size=0"], ["sft.micro_batch_size must be >= 1"]),
    ],
)
def test_config_values_are_checked_before_any_work(tmp_path, overrides, needles):
    proc = rlcli("train", QUICKSTART, f"trainer.output_dir={tmp_path / 'run'}", *overrides)
    assert_exit_2(proc, *needles)
    # Nothing ran: no model was built, no SFT step taken.
    assert not (tmp_path / "run").exists()


def _model_dir(path: Path, model_type: str, weights: str) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": model_type, "vocab_size": 16}))
    (path / weights).write_bytes(b"\0" * 16)
    return path


def test_unsupported_model_family_names_the_supported_ones(tmp_path):
    from parallel.convert import supported_model_types

    model = _model_dir(tmp_path / "gemma", "gemma", "model.safetensors")
    proc = rlcli("train", QUICKSTART, "model.build=false", f"model.path={model}")
    assert_exit_2(proc, "model.path", "'gemma'", *supported_model_types())


def test_model_with_only_bin_weights_says_how_to_convert(tmp_path):
    model = _model_dir(tmp_path / "binonly", "qwen2", "pytorch_model.bin")
    proc = rlcli("train", QUICKSTART, "model.build=false", f"model.path={model}")
    assert_exit_2(proc, "model.path", "safetensors", "save_pretrained")


def test_convert_checks_the_model_folder_the_same_way(tmp_path):
    model = _model_dir(tmp_path / "binonly", "qwen2", "pytorch_model.bin")
    assert_exit_2(rlcli("convert", "verify", "--model", str(model)), "--model", "safetensors")
