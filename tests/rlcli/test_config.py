"""Config loading and the CLI's handling of bad input: exit code 2, a message naming the key."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlcli.config.schema import RLConfig, valid_keys
from rlcli.errors import UserError
from rlcli.validation.loader import load_config
from rlcli.validation.validate import derive_dp

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "recipes" / "quickstart.yaml"


def run_cli(*args: str, cwd: Path = REPO, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlcli.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
    )


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


def test_recipe_and_override_merge_over_defaults():
    cfg = load_config(QUICKSTART, ["actor.lr=1e-5", "rollout.n=4"])
    assert isinstance(cfg, RLConfig)
    assert cfg.actor.lr == 1e-5
    assert cfg.rollout.n == 4
    assert cfg.data.synthetic == "arith"  # from the recipe
    assert cfg.actor.clip_ratio_low == 0.2  # default kept
    assert cfg.model.path == "outputs/quickstart/model"  # interpolation resolved


def test_config_show_prints_resolved_override():
    proc = run_cli("config", "show", str(QUICKSTART), "actor.lr=1e-5")
    assert proc.returncode == 0, proc.stderr
    actor = proc.stdout.split("actor:", 1)[1]
    assert "lr: 1.0e-05" in actor.split("\n\n")[0] or "lr: 1e-05" in actor
    assert "experiment_name: quickstart" in proc.stdout


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["actor.lrr=1e-5"], ["unknown config key 'actor.lrr'", "did you mean 'actor.lr'"]),
        (["rollout.temprature=0.5"], ["rollout.temprature", "did you mean 'rollout.temperature'"]),
        (["actor.lr=abc"], ["actor.lr", "abc"]),
        (["rollout.n=two"], ["rollout.n", "two"]),
        (["actor.lr"], ["override 'actor.lr' must look like key=value"]),
        (["rollout.engine=sglang"], ["rollout.engine='sglang' is not valid", "'vllm', 'hf'"]),
        (["algorithm.adv_estimator=nope"], ["algorithm.adv_estimator", "grpo"]),
        (["actor.ppo_mini_batch_size=3"], ["actor.ppo_mini_batch_size=3 must divide"]),
        (
            ["algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=3"],
            ["critic.ppo_mini_batch_size=3 must divide"],
        ),
        (["rollout.sleep_level=3"], ["rollout.sleep_level='3' is not valid", "1, 2"]),
        (["trainer.critic_warmup=3"], ["trainer.critic_warmup=3 needs a critic"]),
        (["data.synthetic_tool_share=1.5"], ["data.synthetic_tool_share must be in [0, 1]"]),
        (
            ["algorithm.adv_estimator=gae", "critic.loss_agg_mode=nope"],
            ["critic.loss_agg_mode='nope' is not valid"],
        ),
    ],
)
def test_bad_overrides_exit_2_and_name_the_key(args, needles):
    proc = run_cli("config", "show", str(QUICKSTART), *args)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in proc.stderr, proc.stderr


def test_missing_recipe_file():
    proc = run_cli("config", "show", "recipes/does_not_exist.yaml")
    assert proc.returncode == 2
    assert "recipe file not found: recipes/does_not_exist.yaml" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_invalid_yaml_names_file_and_line(tmp_path):
    recipe = write(tmp_path, "actor:\n  lr: 1e-5\n  clip: [1, 2\nrollout:\n  n: 2\n")
    proc = run_cli("config", "validate", str(recipe))
    assert proc.returncode == 2
    assert f"invalid YAML in {recipe} line" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_unknown_key_in_recipe_names_the_file(tmp_path):
    recipe = write(tmp_path, "model:\n  path: /tmp/m\ntrainer:\n  total_step: 3\n")
    with pytest.raises(UserError) as err:
        load_config(recipe)
    assert str(recipe) in str(err.value)
    assert "unknown config key 'trainer.total_step'" in str(err.value)
    assert "did you mean 'trainer.total_steps'" in str(err.value)


def test_wrong_type_in_recipe(tmp_path):
    recipe = write(tmp_path, "model:\n  path: /tmp/m\ndata:\n  train_batch_size: many\n")
    with pytest.raises(UserError, match="data.train_batch_size"):
        load_config(recipe)


def test_impossible_parallel_layout():
    proc = run_cli(
        "config", "validate", str(QUICKSTART), "parallel.tp=2", "parallel.pp=2", "--world-size", "6"
    )
    assert proc.returncode == 2
    assert (
        "world size 6 is not divisible by tp*pp = 4 (parallel.tp=2, parallel.pp=2)" in proc.stderr
    )


def test_valid_layout_reports_derived_dp():
    proc = run_cli("config", "validate", str(QUICKSTART), "parallel.tp=2", "--world-size", "8")
    assert proc.returncode == 0, proc.stderr
    assert "tp=2 pp=1 dp=4" in proc.stdout


def test_derive_dp_and_explicit_dp_mismatch():
    cfg = load_config(QUICKSTART, ["parallel.tp=2", "parallel.dp=3"])
    assert derive_dp(load_config(QUICKSTART, ["parallel.tp=2"]).parallel, 4) == 2
    with pytest.raises(UserError, match="parallel.dp=3 does not match world size 4"):
        derive_dp(cfg.parallel, 4)


def test_empty_model_path_is_rejected(tmp_path):
    with pytest.raises(UserError, match=r"model.path is empty"):
        load_config(write(tmp_path, "rollout:\n  n: 2\n"))


def test_valid_keys_cover_nested_sections():
    keys = valid_keys()
    assert "algorithm.kl_ctrl.kl_coef" in keys
    assert "model.spec.hidden_size" in keys


def test_help_lists_commands():
    proc = run_cli("--help")
    assert proc.returncode == 0
    for command in ("train", "sft", "config", "data"):
        assert command in proc.stdout


def test_validate_looks_up_the_model_folder_and_data_files(tmp_path):
    missing = run_cli("config", "validate", str(QUICKSTART), f"data.val_files=[{tmp_path}/v.jsonl]")
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert f"data.val_files: {tmp_path}/v.jsonl not found" in missing.stderr
    model = run_cli("config", "validate", str(QUICKSTART), "model.build=false")
    assert model.returncode == 2 and "model.path=" in model.stderr
    skipped = run_cli("config", "validate", str(QUICKSTART), "model.build=false", "--no-files")
    assert skipped.returncode == 0, skipped.stderr


def test_gsm8k_data_lands_where_the_gsm8k_recipes_read_it(tmp_path):
    """`rlcli data gsm8k` on a file named as the README's example, then `config validate` of
    recipes/grpo_qwen7b.yaml from the same folder finds its data files."""
    raw = tmp_path / "gsm8k_train.jsonl"
    raw.write_text(json.dumps({"question": "1 + 1?", "answer": "1 + 1 = 2\n#### 2"}) + "\n")
    shutil.copy(raw, tmp_path / "gsm8k_test.jsonl")
    made = run_cli("data", "gsm8k", "--input", str(raw), "--output", "data/gsm8k", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    assert "wrote data/gsm8k/train.jsonl (1 rows)" in made.stdout
    assert "train on them with: data.train_files=[data/gsm8k/train.jsonl]" in made.stdout
    test = tmp_path / "gsm8k_test.jsonl"
    made = run_cli("data", "gsm8k", "--input", str(test), "--output", "data/gsm8k", cwd=tmp_path)
    assert made.returncode == 0 and "data/gsm8k/test.jsonl" in made.stdout
    recipe = REPO / "recipes" / "grpo_qwen7b.yaml"
    # (a built model in place of the 7B one: it trains its tokenizer on a synthetic task's text)
    ok = run_cli(
        "config", "validate", str(recipe), "model.build=true", "data.synthetic=arith",
        "--world-size", "16", cwd=tmp_path,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    (tmp_path / "data" / "gsm8k" / "train.jsonl").unlink()
    missing = run_cli(
        "config", "validate", str(recipe), "model.build=true", "data.synthetic=arith",
        "--world-size", "16", cwd=tmp_path,
    )  # fmt: skip
    assert missing.returncode == 2 and "data/gsm8k/train.jsonl" in missing.stderr, missing.stderr


@pytest.mark.parametrize(
    ("typed", "meant"),
    [
        ("actor.learning_rate", "actor.lr"),  # TRL's name, not the closest spelling
        ("critic.learning_rate", "critic.lr"),
        ("rollout.temp", "rollout.temperature"),
        ("rollout.num_samples", "rollout.n"),
        ("rollout.num_generations", "rollout.n"),
        ("actor_rollout_ref.actor.optim.lr", "actor.lr"),  # verl's full key
        ("trainer.test_freq", "trainer.val_freq"),
        ("trainer.total_step", "trainer.total_steps"),  # a typo: the closest spelling
    ],
)
def test_did_you_mean_knows_the_names_of_verl_and_trl(typed, meant):
    with pytest.raises(UserError, match=f"unknown config key '{typed}'; did you mean '{meant}'"):
        load_config(QUICKSTART, [f"{typed}=1"])


def test_every_peer_name_leads_to_a_real_key():
    from rlcli.validation.peer_names import LAST_PARTS, VERL_KEYS

    assert set(VERL_KEYS.values()) | set(LAST_PARTS.values()) <= set(valid_keys())


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("actor.lr=-1", "actor.lr=-1 makes no sense: it must be in (0, 1)"),
        ("actor.lr=5", "actor.lr=5 makes no sense: it must be in (0, 1)"),
        ("algorithm.gamma=1.5", "algorithm.gamma=1.5 makes no sense: it must be in [0, 1]"),
        ("actor.adam_beta2=1", "actor.adam_beta2=1 makes no sense: it must be in [0, 1)"),
        ("trainer.total_steps=0", "trainer.total_steps must be >= 1"),  # not lr_warmup_steps
        ("actor.min_lr=0.5", "actor.min_lr=0.5 is above actor.lr"),
    ],
)
def test_values_no_run_can_mean_are_refused_by_name(override, message):
    overrides = [override, "actor.lr_warmup_steps=2"] if "total_steps" in override else [override]
    with pytest.raises(UserError, match=re.escape(message)):
        load_config(QUICKSTART, overrides)


def test_a_hub_id_resolves_from_the_local_cache_offline(tmp_path):
    """model.path=org/name with no network (HF_HUB_OFFLINE=1): the snapshot the Hugging Face
    cache holds (laid out as huggingface_hub lays it out) is the model; an id the cache does not
    hold says how to get it."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hf" / "hub" / "models--tiny-org--tiny-qwen"
    config = Qwen2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=128,
    )  # fmt: skip
    Qwen2ForCausalLM(config).save_pretrained(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    offline = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    hub = ["model.build=false", "model.path=tiny-org/tiny-qwen"]
    found = run_cli("config", "validate", str(QUICKSTART), *hub, env=offline)
    assert found.returncode == 0, found.stderr
    missing = run_cli(
        "config", "validate", str(QUICKSTART), "model.build=false", "model.path=tiny-org/other",
        env=offline,
    )  # fmt: skip
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert "model.path=tiny-org/other is not a local path" in missing.stderr
    assert "huggingface-cli download tiny-org/other" in missing.stderr


def test_a_hub_dataset_id_resolves_to_its_split_files_from_the_cache_offline(tmp_path):
    """data.train_files=[org/name:train] with no network: the split's files of the dataset
    snapshot the Hugging Face cache holds; without a split, a dataset of two splits asks for one."""
    from rlcli.data import write_arith_dataset

    commit = "89abcdef0123456789abcdef0123456789abcdef"
    repo = tmp_path / "hf" / "hub" / "datasets--tiny-org--arith"
    data = repo / "snapshots" / commit / "data"
    written = write_arith_dataset(str(tmp_path / "arith"))
    data.mkdir(parents=True)
    shutil.copy(written["train"], data / "train.jsonl")
    shutil.copy(written["val"], data / "test.jsonl")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    offline = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    splits = ["data.train_files=[tiny-org/arith:train]", "data.val_files=[tiny-org/arith:test]"]
    found = run_cli("config", "validate", str(QUICKSTART), *splits, env=offline)
    assert found.returncode == 0, found.stderr
    unsplit = run_cli(
        "config", "validate", str(QUICKSTART), "data.train_files=[tiny-org/arith]", env=offline
    )
    assert unsplit.returncode == 2 and "Traceback" not in unsplit.stderr
    assert "tiny-org/arith has the splits test, train: name one" in unsplit.stderr
