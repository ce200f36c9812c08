"""Run under torchrun (2 CPU processes, gloo) by test_reward_scoring.py: scores 10 samples with
``score_samples`` and writes, per rank, the scores and which rank scored each sample."""

from __future__ import annotations

import json
import os
import sys

import torch.distributed as dist

from rlcli.data.dataset import PromptItem
from rlcli.process_lifetime import exit_skipping_teardown
from rlcli.rewards import RewardManager
from rlcli.rollout.batch import Sample
from rlcli.rollout.sampling import score_samples


class ByteTokenizer:
    def batch_decode(self, ids, skip_special_tokens=True):
        return ["".join(chr(48 + t) for t in row) for row in ids]


def rank_reward(data_source, solution_str, ground_truth, extra_info=None):
    # Rank-dependent on purpose: if two ranks scored one sample they would disagree.
    return {"score": len(solution_str) + 100 * int(os.environ["RANK"]), "by": os.environ["RANK"]}


def main() -> None:
    dist.init_process_group("gloo")
    samples = [
        Sample(
            group=i // 2,
            prompt_ids=[1],
            response_ids=[1] * (i + 1),
            engine_log_probs=[0.0] * (i + 1),
            finish_reason="stop",
            item=PromptItem(index=i, prompt_token_ids=[1], data_source="t", ground_truth="x"),
        )
        for i in range(10)
    ]
    stats = score_samples(samples, RewardManager(rank_reward, in_process=True), ByteTokenizer())
    result = {
        "scores": [s.score for s in samples],
        "by": [s.extras["by"] for s in samples],
        "stats": stats,
    }
    with open(f"{sys.argv[1]}.rank{dist.get_rank()}", "w") as handle:
        json.dump(result, handle)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_skipping_teardown()  # (2 s of interpreter teardown a rank)
