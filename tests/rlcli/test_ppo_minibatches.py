"""How update_actor (rlcli.actor_update) cuts a DP rank's batch into whole-group mini-batches."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rlcli.actor_update import update_actor
from rlcli.batch import Sample, collate
from rlcli.config_loader import load_config


class RecordingPolicy:
    """Stands in for MegatronPolicy.train_step: records the groups of each optimizer step."""

    def __init__(self, refuse: tuple[int, ...] = ()) -> None:
        self.steps: list[list[int]] = []
        self.refuse = refuse  # optimizer steps that report skipped=True

    def train_step(
        self, batch, micro_batch_size, loss_fn, temperature=1.0, compute_entropy=False, max_tokens=0
    ):
        groups = batch["group_index"].tolist()
        skipped = len(self.steps) in self.refuse
        self.steps.append(groups)
        return {
            "micro_batch_metrics": [{"actor/pg_loss": 0.0}],
            "grad_norm": 1.0,
            "lr": 1e-6,
            "skipped": skipped,
        }


def batch_of(num_groups: int, n: int = 2) -> dict[str, torch.Tensor]:
    samples = [
        Sample(g, [1, 2], [3, 4], [-0.5, -0.5], "stop", item=None)
        for g in range(num_groups)
        for _ in range(n)
    ]
    batch = collate(samples, pad_id=0)
    batch["old_log_probs"] = torch.zeros_like(batch["response_mask"])
    batch["advantages"] = torch.zeros_like(batch["response_mask"])
    return batch


@pytest.mark.parametrize(
    ("num_groups", "fewest", "expected"),
    [
        (8, 8, [[0, 1], [2, 3], [4, 5], [6, 7]]),  # 4 mini-batches of 2 prompts
        (5, 5, [[0, 1], [2], [3], [4]]),  # uneven: sizes differ by one, none empty
        (3, 3, [[0], [1], [2]]),  # DAPO kept 3 groups: 3 mini-batches, not 4 with one empty
        (3, 2, [[0, 1], [2]]),  # another DP rank holds only 2 groups: everyone takes 2 steps
    ],
)
def test_mini_batches_are_whole_groups_and_never_empty(num_groups, fewest, expected):
    cfg = load_config(
        None, ["model.path=/m", "data.train_batch_size=8", "actor.ppo_mini_batch_size=2"]
    )
    policy = RecordingPolicy()
    update_actor(policy, batch_of(num_groups), cfg, SimpleNamespace(dp=1), fewest)
    steps = [sorted(set(groups)) for groups in policy.steps]
    assert steps == expected
    for groups in policy.steps:  # both samples of every group travel together
        assert all(groups.count(g) == 2 for g in set(groups))


def test_skipped_optimizer_steps_are_counted():
    cfg = load_config(
        None, ["model.path=/m", "data.train_batch_size=8", "actor.ppo_mini_batch_size=2"]
    )
    metrics = update_actor(
        RecordingPolicy(refuse=(1, 3)), batch_of(8), cfg, SimpleNamespace(dp=1), 8
    )
    assert metrics["actor/optimizer_steps"] == 4.0
    assert metrics["actor/skipped_steps"] == 2.0
