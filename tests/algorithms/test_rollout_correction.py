"""Rollout corrections (``algorithms.rollout_correction``) against a hand computation.

Two sequences, the second one token shorter (its last column is padding):
  row 0: mu = (0.5, 0.2, 0.4), pi_prox = (0.6, 0.6, 0.3): r = (1.2, 3, 0.75), product 2.7,
         geometric mean 2.7^(1/3) = 1.39248;
  row 1: mu = (0.5, 0.5, -),   pi_prox = (0.4, 0.5, -):   r = (0.8, 1),       product 0.8,
         geometric mean 0.8^(1/2) = 0.89443.
seq_is (cap 2):          w = (2, 2, 2 | 0.8, 0.8);           one sequence of two cut at the cap
seq_is_geo (cap 2):      w = (1.39248 x 3 | 0.89443 x 2);    none cut
token_mis [0.5, 2]:      w = (1.2, 0, 0.75 | 0.8, 1);        one token of five masked (r = 3)
seq_mis [0.85, 1.2]:     w = (0, 0, 0 | 0.89443 x 2);        row 0 masked (1.39 > 1.2)
"""

from __future__ import annotations

import pytest
import torch

from algorithms import get_off_policy_correction, get_policy_loss

BEHAVIOUR = torch.tensor([[0.5, 0.2, 0.4], [0.5, 0.5, 1.0]]).log()
PROXIMAL = torch.tensor([[0.6, 0.6, 0.3], [0.4, 0.5, 0.1]]).log()
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
GEO = (2.7 ** (1 / 3), 0.8**0.5)


def terms(name: str, **settings):
    return get_off_policy_correction(name)(
        log_prob=PROXIMAL.clone(),
        behaviour_log_prob=BEHAVIOUR,
        proximal_log_prob=PROXIMAL,
        response_mask=MASK,
        **settings,
    )


def weights_on_tokens(name: str, **settings) -> list[float]:
    result = terms(name, **settings)
    assert torch.equal(result.old_log_prob, PROXIMAL)  # the trust region stays around pi_prox
    return result.weights[MASK.bool()].tolist()


def test_sequence_level_importance_sampling_product_and_geometric():
    assert weights_on_tokens("seq_is", cap=2.0) == pytest.approx([2, 2, 2, 0.8, 0.8], rel=1e-6)
    assert terms("seq_is", cap=2.0).metrics["is_truncated_frac"].item() == pytest.approx(0.5)
    g0, g1 = GEO
    assert weights_on_tokens("seq_is_geo", cap=2.0) == pytest.approx([g0, g0, g0, g1, g1], rel=1e-6)
    assert terms("seq_is_geo", cap=2.0).metrics["is_truncated_frac"].item() == 0.0


def test_masked_importance_sampling_per_token_and_per_sequence():
    token = terms("token_mis", mask_low=0.5, mask_high=2.0)
    assert token.weights[MASK.bool()].tolist() == pytest.approx([1.2, 0, 0.75, 0.8, 1], rel=1e-6)
    assert token.metrics["is_masked_token_frac"].item() == pytest.approx(1 / 5)
    sequence = terms("seq_mis", mask_low=0.85, mask_high=1.2)
    g1 = GEO[1]
    assert sequence.weights[MASK.bool()].tolist() == pytest.approx([0, 0, 0, g1, g1], rel=1e-6)
    assert sequence.metrics["is_masked_seq_frac"].item() == pytest.approx(0.5)
    assert sequence.metrics["is_masked_token_frac"].item() == pytest.approx(3 / 5)


@pytest.mark.parametrize(
    ("name", "settings", "masked"),
    [
        ("token_mis", {"mask_low": 0.5, "mask_high": 2.0}, [[False, True, False], [False] * 3]),
        ("seq_mis", {"mask_low": 0.85, "mask_high": 1.2}, [[True] * 3, [False] * 3]),
    ],
)
def test_masked_tokens_get_no_gradient(name, settings, masked):
    """Through the PPO loss: d loss / d log pi = -w A / tokens where the ratio is 1 (pi = pi_prox,
    inside the clip range); exactly 0 on a masked token."""
    log_prob = PROXIMAL.clone().requires_grad_(True)
    correction = get_off_policy_correction(name)(
        log_prob=log_prob,
        behaviour_log_prob=BEHAVIOUR,
        proximal_log_prob=PROXIMAL,
        response_mask=MASK,
        **settings,
    )
    advantages = torch.ones_like(MASK)
    loss, _ = get_policy_loss("vanilla")(
        old_log_prob=correction.old_log_prob,
        log_prob=log_prob,
        advantages=advantages,
        response_mask=MASK,
        rollout_is_weights=correction.weights,
    )
    loss.backward()
    expected = -correction.weights * MASK / MASK.sum()
    assert torch.allclose(log_prob.grad, expected, atol=1e-7)
    assert (log_prob.grad[torch.tensor(masked)] == 0).all()
    assert (log_prob.grad[MASK.bool() & ~torch.tensor(masked)] != 0).all()


def test_bad_settings_raise():
    with pytest.raises(ValueError, match="0 <= low < high"):
        terms("token_mis", mask_low=2.0, mask_high=0.5)
    with pytest.raises(ValueError, match="proximal log-probs"):
        get_off_policy_correction("seq_is")(
            log_prob=PROXIMAL,
            behaviour_log_prob=BEHAVIOUR,
            proximal_log_prob=None,
            response_mask=MASK,
        )
