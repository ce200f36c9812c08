"""Off-policy corrections against a hand computation (docs/algorithms.md, "Off-policy correction").

Three tokens, behaviour (engine) mu = (0.5, 0.2, 0.4), proximal (trainer before the update)
pi_prox = (0.6, 0.6, 0.3), current pi = (0.78, 0.54, 0.3), advantages (1, 1, -1), cap 2, PPO clip
0.2:

decoupled_ppo: w = min(pi_prox / mu, 2) = (1.2, 3 -> 2, 0.75); r = pi / pi_prox = (1.3, 0.9, 1.0);
  per-token PPO loss max(-A r, -A clip(r, 0.8, 1.2)) = (-1.2, -0.9, 1.0); weighted
  (-1.44, -1.8, 0.75); token-mean -2.49 / 3 = -0.83. d loss / d log pi = (0 [clipped],
  -0.9 * 2 / 3, 1.0 * 0.75 / 3).
tis: w = min(pi / mu, 2) = (1.56, 2.7 -> 2, 0.75); loss per token -w A (ratio 1 in value):
  (-1.56, -2, 0.75); mean -2.81 / 3; d loss / d log pi = -w A / 3 = (-0.52, -2/3, 0.25).
"""

from __future__ import annotations

import math

import pytest
import torch

from algorithms import (
    OFF_POLICY_CORRECTIONS,
    get_off_policy_correction,
    get_policy_loss,
)

BEHAVIOUR = torch.tensor([[0.5, 0.2, 0.4]]).log()
PROXIMAL = torch.tensor([[0.6, 0.6, 0.3]]).log()
CURRENT = torch.tensor([[0.78, 0.54, 0.3]]).log()
ADVANTAGES = torch.tensor([[1.0, 1.0, -1.0]])
MASK = torch.ones(1, 3)


def corrected_loss(name: str):
    log_prob = CURRENT.clone().requires_grad_(True)
    terms = get_off_policy_correction(name)(
        log_prob=log_prob,
        behaviour_log_prob=BEHAVIOUR,
        proximal_log_prob=PROXIMAL,
        response_mask=MASK,
        cap=2.0,
    )
    loss, _ = get_policy_loss("vanilla")(
        old_log_prob=terms.old_log_prob,
        log_prob=log_prob,
        advantages=ADVANTAGES,
        response_mask=MASK,
        clip_ratio_low=0.2,
        clip_ratio_high=0.2,
        rollout_is_weights=terms.weights,
    )
    loss.backward()
    return terms, loss, log_prob.grad


def test_decoupled_ppo_weights_loss_and_gradient_equal_the_hand_computation():
    terms, loss, grad = corrected_loss("decoupled_ppo")
    assert torch.allclose(terms.weights, torch.tensor([[1.2, 2.0, 0.75]]), atol=1e-6)
    assert torch.equal(terms.old_log_prob, PROXIMAL)  # the trust region is the proximal's
    assert loss.item() == pytest.approx(-0.83, abs=1e-6)
    assert torch.allclose(grad, torch.tensor([[0.0, -1.8 / 3, 0.75 / 3]]), atol=1e-6)
    assert terms.metrics["is_weight_mean"].item() == pytest.approx((1.2 + 2 + 0.75) / 3, abs=1e-6)
    assert terms.metrics["is_truncated_frac"].item() == pytest.approx(1 / 3)


def test_truncated_importance_sampling_equals_the_hand_computation():
    terms, loss, grad = corrected_loss("tis")
    assert torch.allclose(terms.weights, torch.tensor([[1.56, 2.0, 0.75]]), atol=1e-6)
    assert loss.item() == pytest.approx(-2.81 / 3, abs=1e-6)
    assert torch.allclose(grad, torch.tensor([[-1.56 / 3, -2 / 3, 0.25]]), atol=1e-6)
    assert terms.metrics["is_truncated_frac"].item() == pytest.approx(1 / 3)
    assert not terms.weights.requires_grad and not terms.old_log_prob.requires_grad


def test_none_is_plain_ppo_against_the_proximal_log_probs():
    terms, loss, _ = corrected_loss("none")
    assert terms.weights is None and torch.equal(terms.old_log_prob, PROXIMAL)
    assert loss.item() == pytest.approx((-1.2 - 0.9 + 1.0) / 3, abs=1e-6)


def test_weights_never_overflow_and_the_registry_names_its_choices():
    huge = get_off_policy_correction("decoupled_ppo")(
        log_prob=torch.zeros(1, 1),
        behaviour_log_prob=torch.tensor([[-1e4]]),
        proximal_log_prob=torch.zeros(1, 1),
        response_mask=torch.ones(1, 1),
        cap=5.0,
    )
    assert huge.weights.item() == pytest.approx(5.0) and math.isfinite(huge.weights.item())
    assert {"none", "decoupled_ppo", "tis"} <= set(OFF_POLICY_CORRECTIONS)
    with pytest.raises(ValueError, match="decoupled_ppo"):
        get_off_policy_correction("aipo")
    with pytest.raises(ValueError, match="proximal"):
        get_off_policy_correction("decoupled_ppo")(
            log_prob=CURRENT,
            behaviour_log_prob=BEHAVIOUR,
            proximal_log_prob=None,
            response_mask=MASK,
        )
