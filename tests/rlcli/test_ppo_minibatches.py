"""How the one mini-batch loop (``TrainedModel.update``, run by ``update_actor``) cuts a DP rank's
batch into whole-group mini-batches."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from parallel.step_types import LossReport, StepResult
from rlcli.model.trained_model import TrainedModel
from rlcli.rollout.batch import RolloutBatch, Sample, collate
from rlcli.train.actor_update import update_actor
from rlcli.validation.loader import load_config


class RecordingModel(TrainedModel):
    """The real mini-batch loop with no Megatron model under it: each optimizer step only
    records the groups it was given."""

    def __init__(self, refuse: tuple[int, ...] = ()) -> None:  # no Megatron model to build
        self.mesh = SimpleNamespace(dp=1)
        self.steps: list[list[int]] = []
        self.refuse = refuse  # optimizer steps that report skipped=True

    def train_step(self, batch, loss_fn, temperature=1.0, compute_entropy=False):
        groups = batch.group_index.tolist()
        skipped = len(self.steps) in self.refuse
        self.steps.append(groups)
        return StepResult(
            [LossReport({"actor/pg_loss": 0.0})], grad_norm=1.0, lr=1e-6, skipped=skipped
        )


def batch_of(num_groups: int, n: int = 2) -> RolloutBatch:
    samples = [
        Sample(g, [1, 2], [3, 4], [-0.5, -0.5], "stop", item=None)
        for g in range(num_groups)
        for _ in range(n)
    ]
    batch = collate(samples, pad_id=0)
    batch.old_log_probs = torch.zeros_like(batch.response_mask)
    batch.advantages = torch.zeros_like(batch.response_mask)
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
    model = RecordingModel()
    update_actor(model, batch_of(num_groups), cfg, fewest)
    steps = [sorted(set(groups)) for groups in model.steps]
    assert steps == expected
    for groups in model.steps:  # both samples of every group travel together
        assert all(groups.count(g) == 2 for g in set(groups))


def test_skipped_optimizer_steps_are_counted():
    cfg = load_config(
        None, ["model.path=/m", "data.train_batch_size=8", "actor.ppo_mini_batch_size=2"]
    )
    metrics = update_actor(RecordingModel(refuse=(1, 3)), batch_of(8), cfg, 8)
    assert metrics["actor/optimizer_steps"] == 4.0
    assert metrics["actor/skipped_steps"] == 2.0
