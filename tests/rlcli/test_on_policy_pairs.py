"""On-policy preference pairs (``rm.on_policy_samples``): the pairing rule on a hand-worked group,
and ``rlcli train``'s reward-model stage end to end on a tiny random quickstart model (HF engine):
the pairs it writes are graded as the reward function grades them (recomputed here), the reward
model trains on them next to the synthetic pairs, and the engine that drew them serves the RL
step. Settings it cannot serve exit 2 naming the key."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rlcli.data import PromptItem
from rlcli.errors import USER_ERROR_EXIT_CODE
from rlcli.rollout.batch import Sample
from rlcli.train.on_policy_pairs import preference_rows
from tests.rlcli.arith_model import build_arith_model
from tests.rlcli.length_reward import compute_score  # the run's reward, called directly

REPO = Path(__file__).resolve().parents[2]
REWARD = Path(__file__).with_name("length_reward.py")


def _sample(group: int, score: float, question: str) -> Sample:
    item = PromptItem(
        index=group,
        prompt_token_ids=[1, 2],
        data_source="arith",
        ground_truth="3",
        prompt_messages=[{"role": "user", "content": question}],
    )
    return Sample(group, [1, 2], [3], [0.0], "stop", item, score=score)


def test_each_prompts_best_response_is_preferred_over_every_distinct_worse_one():
    # prompt 0: "#### 3" right twice, "#### 4" wrong twice, "#### 5" wrong once -> 2 pairs;
    # prompt 1: every response graded alike -> none; prompt 2: a tie at the top keeps the
    # first best response seen ("a") and pairs it with the worse one only.
    graded = [
        (0, 1.0, " #### 3"), (0, 0.0, " #### 4"), (0, 1.0, " #### 3"), (0, 0.0, " #### 5"),
        (0, 0.0, " #### 4"),
        (1, 0.0, " #### 7"), (1, 0.0, " #### 8"),
        (2, 0.5, "a"), (2, 0.5, "b"), (2, 0.2, "c"),
    ]  # fmt: skip
    questions = {0: "1 + 2 = ?", 1: "3 + 4 = ?", 2: "x"}
    samples = [_sample(group, score, questions[group]) for group, score, _ in graded]
    rows = preference_rows(samples, [text for *_, text in graded])
    user = lambda text: [{"role": "user", "content": text}]  # noqa: E731
    assert rows == [
        {"prompt": user("1 + 2 = ?"), "chosen": " #### 3", "rejected": " #### 4"},
        {"prompt": user("1 + 2 = ?"), "chosen": " #### 3", "rejected": " #### 5"},
        {"prompt": user("x"), "chosen": "a", "rejected": "c"},
    ]


def rlcli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlcli.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return build_arith_model(
        tmp_path_factory.mktemp("on_policy_model"),
        hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=128,
    )  # fmt: skip


def test_the_rm_stage_trains_on_graded_on_policy_pairs_and_keeps_its_engine(tiny_model, tmp_path):
    out = tmp_path / "run"
    proc = rlcli(
        "train",
        "recipes/rlhf_quickstart.yaml",
        f"model.path={tiny_model}",
        "model.build=false",
        "sft.steps=0",
        "rm.on_policy_samples=2",
        "rm.steps=2",
        "rm.val_freq=0",
        f"reward.fn={REWARD}:compute_score",  # a random model's samples differ in digits: pairs to make
        "rollout.engine=hf",
        "rollout.max_tokens=6",
        "trainer.total_steps=1",
        "trainer.val_before_train=false",
        "trainer.val_freq=0",
        "checkpoint.save_freq=0",
        f"trainer.output_dir={out}",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    train_rows = [json.loads(line) for line in open(out / "data/rm_on_policy_train.jsonl")]
    val_rows = [json.loads(line) for line in open(out / "data/rm_on_policy_val.jsonl")]
    questions = {json.dumps(json.loads(line)["prompt"]) for line in open(out / "data/train.jsonl")}
    assert train_rows and val_rows
    seen = set()
    for row in train_rows:
        chosen = compute_score("arith", row["chosen"], "0")["score"]
        rejected = compute_score("arith", row["rejected"], "0")["score"]
        assert chosen > rejected, row
        assert json.dumps(row["prompt"]) in questions, row
        key = (json.dumps(row["prompt"]), row["rejected"])
        assert key not in seen, row  # each distinct worse response once
        seen.add(key)
    report = json.loads((out / "reward_model_report.json").read_text())
    synthetic = sum(1 for _ in open(out / "data/rm_train.jsonl"))
    synthetic_val = sum(1 for _ in open(out / "data/rm_val.jsonl"))
    assert report["train_pairs"] == synthetic + len(train_rows)
    assert report["val_pairs"] == synthetic_val + len(val_rows)
    log = proc.stdout
    assert re.search(r"on-policy pairs \(train\): 2 samples of \d+ prompts", log), log[-3000:]
    assert "starting the hf engine for on-policy preference pairs" in log
    assert "starting the hf engine (rollout.tp" not in log  # the rollouts kept that engine
    assert "step 1/1" in log


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["rm.on_policy_samples=-1"], "rm.on_policy_samples must be >= 0"),
        (
            [
                "rm.on_policy_samples=2",
                "rollout.multi_turn.enable=true",
                "rollout.multi_turn.tool_config=recipes/tools/calculator.yaml",
            ],
            "rm.on_policy_samples grades single-turn answers",
        ),
    ],
)
def test_on_policy_settings_it_cannot_serve_are_named(overrides, needle):
    from rlcli.errors import UserError
    from rlcli.validation.loader import load_config
    from rlcli.validation.rewards import check_reward_model_training

    cfg = load_config(REPO / "recipes/rlhf_quickstart.yaml", overrides)
    with pytest.raises(UserError, match=re.escape(needle)):
        check_reward_model_training(cfg, dp=1)


def test_rlcli_rm_says_only_rlcli_train_samples_on_policy_pairs(tmp_path):
    proc = rlcli(
        "rm",
        "recipes/rlhf_quickstart.yaml",
        "rm.on_policy_samples=4",
        f"trainer.output_dir={tmp_path}",
        timeout=120,
    )
    assert proc.returncode == USER_ERROR_EXIT_CODE, proc.stderr[-2000:]
    assert "rm.on_policy_samples=4: only rlcli train samples" in proc.stderr
    assert "Traceback" not in proc.stderr
