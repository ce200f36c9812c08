import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from algorithms import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty_to_rewards,
    compute_kl_loss,
    get_kl_controller,
    kl_penalty,
)

LOGPROB = torch.tensor([[-1.0, -2.0]])
REF = torch.tensor([[-2.0, -1.0]])  # logprob - ref = +1, -1


@pytest.mark.parametrize(
    "kinds, expected",
    [
        (("k1", "kl"), [1.0, -1.0]),
        (("abs",), [1.0, 1.0]),
        (("k2", "mse"), [0.5, 0.5]),
        (("k3", "low_var_kl"), [math.exp(-1) + 1 - 1, math.exp(1) - 1 - 1]),
    ],
)
def test_hand_computed_estimators(kinds, expected):
    for kind in kinds:
        assert kl_penalty(LOGPROB, REF, kind)[0].tolist() == pytest.approx(expected)
        assert kl_penalty(LOGPROB, REF, kind + "+")[0].tolist() == pytest.approx(expected)


def test_low_var_kl_is_clamped_and_unknown_kind_lists_choices():
    far = kl_penalty(torch.tensor([-40.0, -1.0]), torch.tensor([-1.0, -40.0]), "low_var_kl")
    assert far.tolist() == [10.0, 10.0]  # exp(20) - 20 - 1 and exp(-20) + 20 - 1, both capped
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_penalty(LOGPROB, REF, "k4")


@settings(max_examples=30, deadline=None)
@given(
    logprob=st.lists(st.floats(-10, 0), min_size=1, max_size=6),
    shift=st.floats(-3, 3),
    kind=st.sampled_from(["k1", "abs", "k3", "low_var_kl"]),
)
def test_straight_through_value_is_the_estimator_and_gradient_is_k2s(logprob, shift, kind):
    policy = torch.tensor(logprob, dtype=torch.float64)
    ref = policy + shift + torch.linspace(0, 1, len(logprob), dtype=torch.float64)
    straight = (policy.clone().requires_grad_(True), ref.clone().requires_grad_(True))
    k2_inputs = (policy.clone().requires_grad_(True), ref.clone().requires_grad_(True))
    value = kl_penalty(*straight, kind + "+")
    value.sum().backward()
    kl_penalty(*k2_inputs, "k2").sum().backward()
    assert torch.allclose(value, kl_penalty(policy, ref, kind))
    assert torch.allclose(straight[0].grad, k2_inputs[0].grad)
    assert torch.allclose(straight[0].grad, policy - ref)  # d/dlogp of (logp - ref)^2 / 2
    assert torch.allclose(straight[1].grad, k2_inputs[1].grad)


def test_kl_loss_aggregates_the_chosen_estimator():
    mask = torch.tensor([[1.0, 0.0]])
    assert compute_kl_loss(LOGPROB, REF, mask, "k2").item() == pytest.approx(0.5)
    both = compute_kl_loss(LOGPROB, REF, torch.ones(1, 2), "k1", "token-mean")
    assert both.item() == pytest.approx(0.0)


def test_controllers():
    fixed = FixedKLController(0.05)
    fixed.update(current_kl=100.0, n_steps=64)
    assert fixed.value == 0.05

    adaptive = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10_000)
    adaptive.update(current_kl=12.0, n_steps=256)  # error +1 clipped to +0.2
    assert adaptive.value == pytest.approx(0.1 * (1 + 0.2 * 256 / 10_000))
    adaptive.update(current_kl=5.4, n_steps=256)  # error -0.1
    assert adaptive.value == pytest.approx(0.1 * (1 + 0.2 * 0.0256) * (1 - 0.1 * 0.0256))

    assert isinstance(get_kl_controller("fixed", 0.1), FixedKLController)
    built = get_kl_controller("adaptive", 0.1, target_kl=6.0, horizon=100)
    assert isinstance(built, AdaptiveKLController) and built.horizon == 100
    with pytest.raises(ValueError, match="target_kl"):
        get_kl_controller("adaptive", 0.1)
    with pytest.raises(ValueError, match="fixed, adaptive"):
        get_kl_controller("pid", 0.1)


def test_kl_folded_into_rewards_masks_padding_and_updates_the_controller():
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    old_log_prob = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, 50.0]])
    ref_log_prob = torch.tensor([[-1.3, -1.0, -1.3], [-2.0, -1.0, -1.0]])
    controller = AdaptiveKLController(init_kl_coef=0.5, target_kl=0.4, horizon=100)
    rewards, metrics = apply_kl_penalty_to_rewards(
        scores, old_log_prob, ref_log_prob, mask, controller, kind="kl"
    )
    kl = torch.tensor([[0.3, 0.0, 0.3], [1.0, 0.0, 0.0]])  # the padded 51 is ignored
    assert torch.allclose(rewards, scores - 0.5 * kl)
    current_kl = (0.6 / 3 + 1.0 / 2) / 2
    assert metrics["reward_kl_penalty"] == pytest.approx(current_kl)
    assert metrics["reward_kl_penalty_coeff"] == 0.5
    assert controller.value == pytest.approx(0.5 * (1 + (current_kl / 0.4 - 1) * 2 / 100))
