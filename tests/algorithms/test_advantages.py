import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from algorithms import ADVANTAGE_ESTIMATORS, get_advantage_estimator, register_advantage_estimator


def outcome_batch(scores, lengths, length=4):
    """Rewards on the last response token of each row, as a reward function produces them."""
    lengths = torch.tensor(lengths)
    mask = (torch.arange(length)[None] < lengths[:, None]).double()
    rewards = torch.zeros(len(scores), length, dtype=torch.float64)
    rewards[torch.arange(len(scores)), lengths - 1] = torch.tensor(scores, dtype=torch.float64)
    return rewards, mask


def per_sample(advantages, mask):
    """The constant advantage of each row (outcome estimators broadcast one scalar)."""
    return (advantages * mask).sum(-1) / mask.sum(-1)


def test_registry_lists_every_estimator_and_rejects_unknown_names():
    expected = {"gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"}
    expected |= {"remax", "opo", "gpg"}
    assert expected <= set(ADVANTAGE_ESTIMATORS)
    with pytest.raises(ValueError, match="grpo") as error:
        get_advantage_estimator("dr_grpo")
    assert "rloo" in str(error.value)


def test_register_custom_estimator_and_refuse_silent_overwrite():
    @register_advantage_estimator("test_constant")
    def constant(token_level_rewards, response_mask, **kwargs):
        return response_mask.clone(), response_mask.clone()

    try:
        assert get_advantage_estimator("test_constant") is constant
        with pytest.raises(ValueError, match="already registered"):
            register_advantage_estimator("test_constant")(lambda **kwargs: None)
    finally:
        ADVANTAGE_ESTIMATORS.pop("test_constant")


def test_grpo_hand_computed_with_singleton_group():
    rewards, mask = outcome_batch([1, 0, 0, 1, 2], [4, 2, 3, 1, 2])
    grpo = get_advantage_estimator("grpo")
    advantages, returns = grpo(
        token_level_rewards=rewards, response_mask=mask, group_index=np.array(list("aaaab"))
    )
    std = math.sqrt(4 * 0.25 / 3)  # unbiased std of [1, 0, 0, 1]
    expected = [0.5 / (std + 1e-6), -0.5 / (std + 1e-6), -0.5 / (std + 1e-6), 0.5 / (std + 1e-6)]
    assert per_sample(advantages, mask).tolist() == pytest.approx(expected + [2.0])
    assert torch.equal(advantages, returns)
    assert (advantages[mask == 0] == 0).all()

    dr_grpo, _ = grpo(
        token_level_rewards=rewards,
        response_mask=mask,
        group_index=torch.tensor([0, 0, 0, 0, 1]),
        norm_adv_by_std=False,
    )
    assert per_sample(dr_grpo, mask).tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5, 2.0])


@settings(max_examples=40, deadline=None)
@given(
    group_sizes=st.lists(st.integers(1, 5), min_size=1, max_size=5),
    seed=st.integers(0, 10_000),
    norm_adv_by_std=st.booleans(),
)
def test_grpo_group_zero_mean_and_invariant_to_a_group_constant(group_sizes, seed, norm_adv_by_std):
    generator = torch.Generator().manual_seed(seed)
    group_index = torch.repeat_interleave(torch.arange(len(group_sizes)), torch.tensor(group_sizes))
    batch = len(group_index)
    scores = torch.randint(0, 3, (batch,), generator=generator).double()
    lengths = torch.randint(1, 5, (batch,), generator=generator).tolist()
    rewards, mask = outcome_batch(scores.tolist(), lengths)
    grpo = get_advantage_estimator("grpo")
    kwargs = dict(response_mask=mask, group_index=group_index, norm_adv_by_std=norm_adv_by_std)
    advantages = per_sample(grpo(token_level_rewards=rewards, **kwargs)[0], mask)

    offsets = torch.randn(len(group_sizes), generator=generator, dtype=torch.float64)
    shifted_rewards, _ = outcome_batch((scores + offsets[group_index]).tolist(), lengths)
    shifted = per_sample(grpo(token_level_rewards=shifted_rewards, **kwargs)[0], mask)
    for group, size in enumerate(group_sizes):
        members = group_index == group
        if size > 1:
            assert advantages[members].sum().item() == pytest.approx(0.0, abs=1e-9)
            assert torch.allclose(shifted[members], advantages[members], atol=1e-6)
        else:  # a group of one keeps its raw reward
            assert advantages[members].item() == pytest.approx(scores[members].item())


def test_rloo_is_reward_minus_mean_of_the_others():
    rewards, mask = outcome_batch([1, 0, 0, 3], [1, 2, 3, 4])
    advantages, _ = get_advantage_estimator("rloo")(
        token_level_rewards=rewards, response_mask=mask, group_index=[0, 0, 0, 1]
    )
    assert per_sample(advantages, mask).tolist() == pytest.approx([1.0, -0.5, -0.5, 3.0])


def test_opo_uses_length_weighted_baseline():
    rewards, mask = outcome_batch([1, 0, 5], [2, 3, 1])
    advantages, _ = get_advantage_estimator("opo")(
        token_level_rewards=rewards, response_mask=mask, group_index=[0, 0, 1]
    )
    # baseline (2 * 1 + 3 * 0) / 5 = 0.4; the singleton keeps its reward
    assert per_sample(advantages, mask).tolist() == pytest.approx([0.6, -0.4, 5.0])


def test_gpg_rescales_by_share_of_nonzero_rewards():
    rewards, mask = outcome_batch([1, 0, 0, 1], [4, 4, 4, 4])
    advantages, _ = get_advantage_estimator("gpg")(
        token_level_rewards=rewards, response_mask=mask, group_index=[0, 0, 0, 0]
    )
    # alpha = 4 samples / 2 non-zero = 2; mean 0.5
    assert per_sample(advantages, mask).tolist() == pytest.approx([1.0, -1.0, -1.0, 1.0])


def test_remax_subtracts_greedy_baseline_from_return_to_go():
    rewards = torch.tensor([[0.0, 0.5, 1.0], [2.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    advantages, returns = get_advantage_estimator("remax")(
        token_level_rewards=rewards, response_mask=mask, reward_baselines=torch.tensor([0.3, 1.0])
    )
    assert returns.tolist() == [[1.5, 1.5, 1.0], [2.0, 0.0, 0.0]]
    assert torch.allclose(advantages, torch.tensor([[1.2, 1.2, 0.7], [1.0, 0.0, 0.0]]))


def test_reinforce_plus_plus_discounts_and_whitens_over_the_batch():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    advantages, returns = get_advantage_estimator("reinforce_plus_plus")(
        token_level_rewards=rewards, response_mask=mask, gamma=0.5
    )
    assert returns.tolist() == [[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]]
    valid = torch.tensor([0.25, 0.5, 1.0, 1.0, 2.0], dtype=torch.float64)
    expected = (valid - valid.mean()) / torch.sqrt(valid.var() + 1e-8)
    assert torch.allclose(advantages[mask.bool()], expected)
    assert advantages[1, 2] == 0


def test_reinforce_plus_plus_baseline_centres_per_group_then_whitens():
    rewards, mask = outcome_batch([1, 0, 4], [2, 1, 2], length=2)
    advantages, _ = get_advantage_estimator("reinforce_plus_plus_baseline")(
        token_level_rewards=rewards, response_mask=mask, group_index=[0, 0, 1]
    )
    # centred: 0.5 (2 tokens), -0.5 (1 token), 4 (2 tokens, singleton: baseline 0)
    tokens = torch.tensor([0.5, 0.5, -0.5, 4.0, 4.0], dtype=torch.float64)
    expected = (tokens - tokens.mean()) / torch.sqrt(tokens.var() + 1e-8)
    assert torch.allclose(advantages[mask.bool()], expected)


def test_gae_hand_computed_and_skips_padding_inside_a_response():
    rewards = torch.tensor([[0.0, 1.0], [0.0, 1.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.2], [0.5, 0.2]], dtype=torch.float64)
    mask = torch.ones(2, 2, dtype=torch.float64)
    advantages, returns = get_advantage_estimator("gae")(
        token_level_rewards=rewards, response_mask=mask, values=values, gamma=0.9, lam=0.8
    )
    # t=1: delta 1 - 0.2 = 0.8; t=0: delta 0.9 * 0.2 - 0.5 = -0.32, A = -0.32 + 0.72 * 0.8 = 0.256
    assert returns[0].tolist() == pytest.approx([0.256 + 0.5, 0.8 + 0.2])
    raw = torch.tensor([0.256, 0.8, 0.256, 0.8], dtype=torch.float64)
    expected = (raw - raw.mean()) / torch.sqrt(raw.var() + 1e-8)
    assert torch.allclose(advantages.flatten(), expected)

    # A masked (e.g. tool-output) token in the middle is skipped: its value 9.0 is never used.
    gapped_advantages, gapped_returns = get_advantage_estimator("gae")(
        token_level_rewards=torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 1.0]]),
        response_mask=torch.tensor([[1.0, 0.0, 1.0], [1.0, 0.0, 1.0]]),
        values=torch.tensor([[0.5, 9.0, 0.2], [0.5, 9.0, 0.2]]),
    )
    assert gapped_returns[0].tolist() == pytest.approx([1.0, 0.0, 1.0])
    assert gapped_advantages[:, 1].abs().max() == 0


def test_gae_with_lambda_one_is_monte_carlo_return_minus_value():
    generator = torch.Generator().manual_seed(3)
    rewards = torch.randn(5, 6, generator=generator, dtype=torch.float64)
    values = torch.randn(5, 6, generator=generator, dtype=torch.float64)
    mask = torch.ones(5, 6, dtype=torch.float64)
    gamma = 0.95
    _, returns = get_advantage_estimator("gae")(
        token_level_rewards=rewards, response_mask=mask, values=values, gamma=gamma, lam=1.0
    )
    discounts = gamma ** torch.arange(6, dtype=torch.float64)
    for t in range(6):
        monte_carlo = (rewards[:, t:] * discounts[: 6 - t]).sum(-1)
        assert torch.allclose(returns[:, t], monte_carlo)


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_every_estimator_takes_the_full_keyword_set(name):
    rewards, mask = outcome_batch([1, 0, 1, 2, 0, 1], [4, 2, 3, 1, 4, 4])
    advantages, returns = get_advantage_estimator(name)(
        token_level_rewards=rewards,
        response_mask=mask,
        group_index=np.array(["p0", "p0", "p0", "p1", "p1", "p2"], dtype=object),
        values=torch.zeros_like(rewards),
        gamma=1.0,
        lam=1.0,
        reward_baselines=torch.zeros(6, dtype=torch.float64),
        epsilon=1e-6,
        norm_adv_by_std=True,
        some_future_argument="ignored",
    )
    assert advantages.shape == returns.shape == rewards.shape
    assert torch.isfinite(advantages).all()
    assert (advantages[mask == 0] == 0).all()
