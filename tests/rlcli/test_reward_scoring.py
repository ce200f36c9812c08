"""Rewards are scored once per sample: each rank scores its share and every rank ends with the
same scores; a failure rate over reward.max_failure_rate stops the run with the reward's error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlcli.data.dataset import PromptItem
from rlcli.errors import UserError
from rlcli.rewards import RewardManager
from rlcli.rollout.batch import Sample
from rlcli.rollout.sampling import score_samples
from tests.parallel.dist_utils import run_torchrun
from tests.rlcli.failing_reward import compute_score as failing
from tests.rlcli.scoring_worker import ByteTokenizer

WORKER = Path(__file__).with_name("scoring_worker.py")


def _samples(n: int) -> list[Sample]:
    item = PromptItem(index=0, prompt_token_ids=[1], data_source="t", ground_truth="x")
    return [Sample(0, [1], [2] * (i + 1), [0.0] * (i + 1), "stop", item) for i in range(n)]


@pytest.mark.dist
def test_each_sample_is_scored_once_and_all_ranks_agree(tmp_path):
    run_torchrun(WORKER, 2, str(tmp_path / "out"), timeout_s=300)
    rank0 = json.loads((tmp_path / "out.rank0").read_text())
    rank1 = json.loads((tmp_path / "out.rank1").read_text())
    assert rank0 == rank1  # every rank trains on the same numbers
    # Rank r scored its contiguous half: length + 100 r, computed here independently.
    assert rank0["by"] == ["0"] * 5 + ["1"] * 5
    assert rank0["scores"] == [i + 1 + (100 if i >= 5 else 0) for i in range(10)]
    assert rank0["stats"] == {"reward/num_failed": 0.0, "reward/num_timeout": 0.0}


def test_failure_rate_over_the_limit_stops_with_the_rewards_own_error():
    rewards = RewardManager(failing, in_process=True)
    with pytest.raises(UserError) as raised:
        score_samples(_samples(4), rewards, ByteTokenizer(), max_failure_rate=0.5, step=7)
    message = str(raised.value)
    assert "step 7" in message and "failed on 4 of 4 samples" in message
    assert "reward.max_failure_rate=0.5" in message
    assert "TypeError: compute_score() got an unexpected keyword argument" in message


def test_failures_under_the_limit_score_zero_and_are_counted():
    calls = iter(range(100))

    def every_fourth_fails(data_source, solution_str, ground_truth, extra_info=None):
        if next(calls) % 4 == 0:
            raise ValueError("bad row")
        return 1.0

    samples = _samples(8)
    rewards = RewardManager(every_fourth_fails, in_process=True)
    stats = score_samples(samples, rewards, ByteTokenizer(), max_failure_rate=0.5)
    assert stats["reward/num_failed"] == 2
    assert [s.score for s in samples] == [0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0]


def test_texts_the_caller_decoded_are_the_ones_scored():
    def length(data_source, solution_str, ground_truth, extra_info=None):
        return float(len(solution_str))

    samples = _samples(3)
    rewards = RewardManager(length, in_process=True)
    score_samples(samples, rewards, ByteTokenizer())
    decoded = [s.score for s in samples]
    texts = ["x" * 10, "y" * 20, "z" * 30]  # not what the tokenizer would give
    score_samples(samples, rewards, ByteTokenizer(), texts=texts)
    assert [s.score for s in samples] == [10.0, 20.0, 30.0]
    assert decoded != [10.0, 20.0, 30.0]
