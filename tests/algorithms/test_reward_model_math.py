"""algorithms.reward_model (Bradley-Terry loss) and algorithms.reward_shaping (running
normalisation, combination with rule rewards) against hand computations."""

from __future__ import annotations

import math

import pytest
import torch

from algorithms import RunningMeanStd, bradley_terry_loss, combine_rewards


def _nll(d: float) -> float:
    """-log sigmoid(d), by hand."""
    return math.log(1.0 + math.exp(-d))


def _sigmoid(d: float) -> float:
    return 1.0 / (1.0 + math.exp(-d))


def test_bradley_terry_loss_and_gradients_by_hand():
    chosen = torch.tensor([2.0, 0.5, -1.0], requires_grad=True)
    rejected = torch.tensor([1.0, 0.5, 0.0], requires_grad=True)
    loss, metrics = bradley_terry_loss(chosen, rejected)
    differences = [1.0, 0.0, -1.0]
    assert loss.item() == pytest.approx(sum(map(_nll, differences)) / 3)
    loss.backward()
    # d(-log sigmoid(d)) / dd = -sigmoid(-d); d = chosen - rejected; mean over 3 pairs
    expected = [-_sigmoid(-d) / 3 for d in differences]
    assert chosen.grad.tolist() == pytest.approx(expected)
    assert rejected.grad.tolist() == pytest.approx([-g for g in expected])
    assert metrics["accuracy"].item() == pytest.approx((1 + 0.5 + 0) / 3)  # a tie is one half
    assert metrics["score_margin"].item() == pytest.approx(0.0)
    assert metrics["chosen_score"].item() == pytest.approx(0.5)
    assert metrics["rejected_score"].item() == pytest.approx(0.5)


def test_bradley_terry_margin_mask_and_denominator():
    chosen = torch.tensor([2.0, 0.5, 9.0], requires_grad=True)
    rejected = torch.tensor([1.0, 0.5, -9.0])
    margin = torch.tensor([0.5, 1.0, 0.0])
    mask = torch.tensor([1.0, 1.0, 0.0])  # the third pair is a filler
    loss, metrics = bradley_terry_loss(chosen, rejected, margin, pair_mask=mask, denominator=4.0)
    assert loss.item() == pytest.approx((_nll(1.0 - 0.5) + _nll(0.0 - 1.0)) / 4)
    loss.backward()
    assert chosen.grad.tolist() == pytest.approx([-_sigmoid(-0.5) / 4, -_sigmoid(1.0) / 4, 0.0])
    # the margin shifts the loss, not the accuracy: pair 0 wins, pair 1 ties
    assert metrics["accuracy"].item() == pytest.approx(0.75)


def test_bradley_terry_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="equal"):
        bradley_terry_loss(torch.zeros(3), torch.zeros(2))


def test_running_mean_std_equals_the_statistics_of_everything_seen():
    batches = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([10.0]), torch.tensor([-4.0, 0.5])]
    running = RunningMeanStd()
    for batch in batches:
        running.update(batch)
    seen = torch.cat(batches).double()
    assert running.count == 6
    assert running.mean == pytest.approx(seen.mean().item())
    assert running.std == pytest.approx(seen.std(unbiased=False).item())
    normalized = running.normalize(torch.tensor([running.mean + running.std]))
    assert normalized.item() == pytest.approx(1.0, rel=1e-5)

    restored = RunningMeanStd()
    restored.load_state_dict(running.state_dict())
    assert restored.state_dict() == running.state_dict()
    # before any score: identity scale, zero shift
    assert RunningMeanStd().normalize(torch.tensor([3.0])).item() == pytest.approx(3.0, rel=1e-5)


def test_combine_rewards_weighted_sum_and_gate():
    rule = torch.tensor([1.0, 0.0, 1.0])
    model = torch.tensor([0.3, 2.0, -1.0])
    summed = combine_rewards(rule, model, "weighted_sum", rule_weight=2.0, model_weight=0.5)
    assert summed.tolist() == pytest.approx([2.15, 1.0, 1.5])
    gated = combine_rewards(rule, model, "gate", model_weight=2.0, gate_fail_reward=-1.0)
    # the rule passes for samples 0 and 2 only: the model's score counts there
    assert gated.tolist() == pytest.approx([0.6, -1.0, -2.0])
    with pytest.raises(ValueError, match="weighted_sum"):
        combine_rewards(rule, model, "product")
