"""End to end: `rlcli train` with multi-turn rollouts under torchrun, DP2 (PPO's critic, held-out
validation) and rollout TP2 (one vLLM engine over both ranks, DAPO's dynamic sampling).

The model is built locally with a ChatML template and is random, so it never calls a tool; an
environment that echoes each turn back twice makes every trajectory three assistant turns with
non-generated tokens between them, and the calculator tool is configured all the same. Each run
checks the multi-turn metrics, and that the trainer and the engine agree on the generated tokens'
log-probs (a mask or alignment mistake shows there at once).
"""

from __future__ import annotations

import math

import pytest

from tests.rlcli.test_train_e2e import REPO, records, train

ECHO = REPO / "tests" / "rlcli" / "tools" / "user_environments.py"
MULTI_TURN = [
    "data.synthetic=tool_multiply",
    "data.max_prompt_length=48",
    "model.spec.chat_template=chatml",
    "rollout.multi_turn.enable=true",
    f"rollout.multi_turn.tool_config={REPO / 'recipes' / 'tools' / 'calculator.yaml'}",
    f"rollout.multi_turn.environment={ECHO}:EchoEnvironment",
    "rollout.multi_turn.environment_kwargs={turns: 2}",
    "rollout.multi_turn.max_response_tokens=96",
    "trainer.total_steps=2",
    "checkpoint.save_freq=0",
]


def check_multi_turn_step(record: dict) -> None:
    for key in ("multi_turn/turns_mean", "multi_turn/masked_token_ratio", "tool/calls"):
        assert key in record and math.isfinite(record[key]), (key, sorted(record))
    assert record["multi_turn/turns_mean"] > 1.5, record["multi_turn/turns_mean"]
    assert 0 < record["multi_turn/masked_token_ratio"] < 1
    assert record["rollout/logprob_diff_max"] < 1e-3, record["rollout/logprob_diff_max"]


@pytest.mark.dist
@pytest.mark.vllm
def test_dp2_multi_turn_with_ppo_critic_and_validation(tmp_path):
    out = tmp_path / "run"
    train(
        out,
        *MULTI_TURN,
        "rollout.engine=vllm",
        "algorithm.adv_estimator=gae",
        "trainer.val_before_train=true",
    )
    steps = records(out)
    assert [r["step"] for r in steps] == [0, 1, 2]
    assert steps[0]["val/multi_turn/turns_mean"] > 1.5
    for record in steps[1:]:
        check_multi_turn_step(record)
        assert math.isfinite(record["critic/vf_loss"]), record


@pytest.mark.dist
@pytest.mark.vllm
def test_rollout_tp2_multi_turn_with_dynamic_sampling(tmp_path):
    out = tmp_path / "run"
    train(
        out,
        *MULTI_TURN,
        "parallel.tp=2",
        "rollout.tp=2",
        "rollout.engine=vllm",
        "algorithm.dynamic_sampling.enabled=true",
        "algorithm.dynamic_sampling.max_gen_batches=2",
    )
    steps = records(out)
    assert [r["step"] for r in steps] == [1, 2]
    for record in steps:
        check_multi_turn_step(record)
        assert "dapo/kept_groups_ratio" in record
