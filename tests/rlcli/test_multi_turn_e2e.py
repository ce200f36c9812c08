"""End to end: `rlcli train` (GRPO) with multi-turn rollouts and the real calculator tool, under
torchrun: training DP2 and one vLLM engine over both ranks (rollout TP2, so the replica's leader
runs the tools and shares the turn with the other rank), held-out validation before and after.

The model is the one of ``multi_turn_model.py``, which writes back its memorised 3-turn
conversation: a malformed call (the parser's error text is the response), a good call (the
calculator answers), the final answer. So every trajectory really calls the tool twice, through
the trainer's rollout phase, rewards, log-probs, update and weight sync. Each step checks the
multi-turn metrics, and that the trainer and the engine agree on the generated tokens'
log-probs (a mask or alignment mistake shows there at once).
"""

from __future__ import annotations

import json
import math

import pytest

from tests.rlcli.multi_turn_model import QUESTION, build_memorised_model, write_tool_config
from tests.rlcli.test_train_e2e import records, train


def write_rows(path, count: int):
    row = {
        "data_source": "tool_multiply",
        "agent_name": "tool_agent",
        "prompt": [{"role": "user", "content": QUESTION}],
        "reward_model": {"ground_truth": "201954"},
        "extra_info": {"tools_kwargs": {"calculator": {"create_kwargs": {}}}},
    }
    path.write_text(
        "".join(
            json.dumps({**row, "extra_info": {**row["extra_info"], "index": i}}) + "\n"
            for i in range(count)
        )
    )
    return path


def memorised_run(model, tmp_path) -> list[str]:
    """The settings of a 2-step GRPO run of the memorised model on 8 rows of its question, with
    one vLLM engine over two ranks (its trajectories: ``multi_turn_model.py``), held-out before
    and after, no checkpoints."""
    return [
        "data.synthetic=null",
        f"data.train_files=[{write_rows(tmp_path / 'train.jsonl', 8)}]",
        f"data.val_files=[{write_rows(tmp_path / 'val.jsonl', 2)}]",
        "data.max_prompt_length=64",
        "model.build=false",
        f"model.path={model}",
        "actor.lr=1e-5",  # its memorised turns stay near-certain
        "reward.fn=null",  # by data_source: the number after the last ####
        "rollout.engine=vllm",
        "rollout.tp=2",
        "rollout.temperature=0.5",
        "rollout.max_tokens=48",
        "trainer.total_steps=2",
        "trainer.val_before_train=true",
        "checkpoint.save_freq=0",
    ]


@pytest.mark.dist
@pytest.mark.vllm
def test_grpo_with_tool_calls_dp2_rollout_tp2(tmp_path):
    model = build_memorised_model(tmp_path / "model")
    out = tmp_path / "run"
    train(
        out,
        *memorised_run(model, tmp_path),
        "rollout.multi_turn.enable=true",
        f"rollout.multi_turn.tool_config={write_tool_config(tmp_path / 'tools.json')}",
        "rollout.multi_turn.max_response_tokens=256",  # the conversation: 192 tokens
    )
    steps = records(out)
    assert [r["step"] for r in steps] == [0, 1, 2]
    for record in steps[1:]:
        for key in ("multi_turn/turns_mean", "multi_turn/masked_token_ratio", "tool/calls"):
            assert key in record and math.isfinite(record[key]), (key, sorted(record))
        assert record["multi_turn/turns_mean"] == 3.0, record
        assert record["multi_turn/tool_calls_mean"] == 2.0, record
        assert record["tool/error_rate"] == 0.5, record  # the malformed call of every trajectory
        assert record["multi_turn/budget_cut_rate"] == 0.0
        assert 0 < record["multi_turn/masked_token_ratio"] < 1
        assert record["reward/accuracy"] == 1.0, record
        assert record["rollout/logprob_diff_max"] < 1e-3, record["rollout/logprob_diff_max"]
        assert math.isfinite(record["actor/pg_loss"])
    for record in (steps[0], steps[-1]):
        assert record["val/reward/accuracy"] == 1.0 and record["val/multi_turn/turns_mean"] == 3.0
