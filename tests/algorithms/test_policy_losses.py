import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from algorithms import POLICY_LOSSES, agg_loss_denominator, get_policy_loss, register_policy_loss


def test_registry_lists_every_loss_and_rejects_unknown_names():
    assert {"vanilla", "gspo", "cispo", "clip_cov", "kl_cov"} <= set(POLICY_LOSSES)
    with pytest.raises(ValueError, match="vanilla") as error:
        get_policy_loss("ppo")
    assert "gspo" in str(error.value)

    @register_policy_loss("test_zero")
    def zero(log_prob, **kwargs):
        return log_prob.sum() * 0, {}

    try:
        assert get_policy_loss("test_zero") is zero
        with pytest.raises(ValueError, match="already registered"):
            register_policy_loss("test_zero")(lambda **kwargs: None)
    finally:
        POLICY_LOSSES.pop("test_zero")


def test_vanilla_hand_computed_clip_higher_and_dual_clip():
    ratios = torch.tensor([[1.5, 0.5, 1.5, 5.0, 0.5]])
    advantages = torch.tensor([[1.0, 1.0, -1.0, -1.0, -1.0]])
    old_log_prob = torch.full_like(ratios, -2.0)
    log_prob = old_log_prob + ratios.log()
    loss, metrics = get_policy_loss("vanilla")(
        old_log_prob=old_log_prob,
        log_prob=log_prob,
        advantages=advantages,
        response_mask=torch.ones_like(ratios),
        loss_agg_mode="token-mean",
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
    )
    # per token: -min(1.5, 1.28); -0.5; max(1.5, 1.28); min(max(5, 1.28), 3); max(0.5, 0.8)
    token_losses = [-1.28, -0.5, 1.5, 3.0, 0.8]
    assert loss.item() == pytest.approx(sum(token_losses) / 5, rel=1e-6)
    assert metrics["pg_clipfrac"].item() == pytest.approx(2 / 5)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(1 / 5)
    assert metrics["ppo_kl"].item() == pytest.approx(-ratios.log().mean().item(), rel=1e-5)


@settings(max_examples=40, deadline=None)
@given(
    ratio=st.floats(0.81, 1.27),
    advantage=st.floats(-5, 5).filter(lambda a: abs(a) > 1e-3),
    old=st.floats(-8, -0.1),
)
def test_vanilla_equals_minus_advantage_times_ratio_inside_the_clip_range(ratio, advantage, old):
    old_log_prob = torch.tensor([[old]], dtype=torch.float64)
    log_prob = (old_log_prob + math.log(ratio)).requires_grad_(True)
    loss, metrics = get_policy_loss("vanilla")(
        old_log_prob=old_log_prob,
        log_prob=log_prob,
        advantages=torch.tensor([[advantage]], dtype=torch.float64),
        response_mask=torch.ones(1, 1),
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
    )
    loss.backward()
    assert loss.item() == pytest.approx(-advantage * ratio, rel=1e-9)
    assert log_prob.grad.item() == pytest.approx(-advantage * ratio, rel=1e-9)  # d ratio = ratio
    assert metrics["pg_clipfrac"].item() == 0


def test_vanilla_clipped_tokens_get_no_gradient_and_log_ratio_is_clamped():
    old_log_prob = torch.tensor([[-1.0, -1.0]])
    log_prob = torch.tensor([[-1.0 + math.log(2.0), 49.0]], requires_grad=True)
    loss, metrics = get_policy_loss("vanilla")(
        old_log_prob=old_log_prob,
        log_prob=log_prob,
        advantages=torch.tensor([[1.0, 1.0]]),
        response_mask=torch.ones(1, 2),
    )
    loss.backward()
    assert torch.isfinite(loss) and loss.item() == pytest.approx(-1.2)
    assert log_prob.grad.abs().max() == 0
    assert metrics["ppo_kl"].item() == pytest.approx(-(math.log(2.0) + 20.0) / 2)  # 50 -> 20
    with pytest.raises(ValueError, match="clip_ratio_c"):
        get_policy_loss("vanilla")(
            old_log_prob=old_log_prob,
            log_prob=log_prob,
            advantages=torch.ones(1, 2),
            response_mask=torch.ones(1, 2),
            clip_ratio_c=1.0,
        )


def test_gspo_uses_the_length_normalised_sequence_ratio():
    old_log_prob = torch.tensor([[-1.0, -2.0, -1.0], [-1.0, -1.0, -1.0]], dtype=torch.float64)
    log_ratio = torch.tensor([[0.1, 0.3, 7.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    log_prob = (old_log_prob + log_ratio).requires_grad_(True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    loss, metrics = get_policy_loss("gspo")(
        old_log_prob=old_log_prob,
        log_prob=log_prob,
        advantages=torch.tensor([[2.0] * 3, [1.0] * 3], dtype=torch.float64),
        response_mask=mask,
        loss_agg_mode="seq-mean-token-mean",
        clip_ratio_low=0.2,
        clip_ratio_high=0.3,
    )
    loss.backward()
    seq_ratio = math.exp(0.2)  # mean of 0.1 and 0.3; the padded 7.0 is ignored
    # row 0 unclipped: token loss -2 * s; row 1: exp(1) > 1.3 so clipped to -1.3, no gradient
    assert loss.item() == pytest.approx((-2 * seq_ratio + -1.3) / 2)
    # each token's gradient is -A * s_i / (tokens in row) / (rows)
    assert log_prob.grad[0, :2].tolist() == pytest.approx([-2 * seq_ratio / 2 / 2] * 2)
    assert log_prob.grad[1].abs().max() == 0
    assert metrics["pg_clipfrac"].item() == pytest.approx(3 / 5)


def test_cispo_keeps_gradient_of_clipped_tokens_with_bounded_weight():
    old_log_prob = torch.tensor([[-1.0, -1.0]], dtype=torch.float64)
    log_prob = (old_log_prob + torch.tensor([[math.log(1.5), 0.0]])).requires_grad_(True)
    loss, metrics = get_policy_loss("cispo")(
        old_log_prob=old_log_prob,
        log_prob=log_prob,
        advantages=torch.tensor([[1.0, -2.0]], dtype=torch.float64),
        response_mask=torch.ones(1, 2),
        clip_ratio_low=0.2,
        clip_ratio_high=0.2,
    )
    loss.backward()
    expected = (-1.2 * 1.0 * log_prob[0, 0] + 1.0 * 2.0 * log_prob[0, 1]) / 2
    assert loss.item() == pytest.approx(expected.item())
    assert log_prob.grad[0].tolist() == pytest.approx([-1.2 / 2, 2.0 / 2])
    assert metrics["pg_clipfrac"].item() == pytest.approx(0.5)


# Advantages and log-probs with mean 0 and -2: covariance terms (A - 0) * (logp + 2) = 2, 1, 0, 0.
COV_ADVANTAGES = torch.tensor([[2.0, -1.0, -1.0, 0.0]], dtype=torch.float64)
COV_LOG_PROB = torch.tensor([[-1.0, -3.0, -2.0, -2.0]], dtype=torch.float64)


def test_clip_cov_cuts_gradient_of_tokens_with_covariance_inside_the_bounds():
    log_prob = COV_LOG_PROB.clone().requires_grad_(True)
    loss, metrics = get_policy_loss("clip_cov")(
        old_log_prob=COV_LOG_PROB,
        log_prob=log_prob,
        advantages=COV_ADVANTAGES,
        response_mask=torch.ones(1, 4),
        clip_cov_ratio=0.5,  # up to 2 tokens, but only token 0 has covariance in (1, 5)
        clip_cov_lb=1.0,
        clip_cov_ub=5.0,
    )
    loss.backward()
    assert loss.item() == pytest.approx((0 + 1 + 1 + 0) / 4)  # token 0's -A * ratio is zeroed
    assert log_prob.grad[0].tolist() == pytest.approx([0.0, 0.25, 0.25, 0.0])
    assert metrics["pg_clipfrac"].item() == pytest.approx(0.25)


def test_kl_cov_adds_abs_kl_to_the_highest_covariance_tokens():
    old_log_prob = COV_LOG_PROB - 0.1
    loss, metrics = get_policy_loss("kl_cov")(
        old_log_prob=old_log_prob,
        log_prob=COV_LOG_PROB,
        advantages=COV_ADVANTAGES,
        response_mask=torch.ones(1, 4),
        kl_cov_ratio=0.25,
        ppo_kl_coef=3.0,
    )
    ratio = math.exp(0.1)
    surrogate = [-2.0 * ratio, ratio, ratio, 0.0]
    assert loss.item() == pytest.approx((sum(surrogate) + 3.0 * 0.1) / 4)
    assert metrics["ppo_kl"].item() == pytest.approx(0.1)
    assert metrics["pg_clipfrac"].item() == pytest.approx(0.25)


def _random_policy_inputs(seed, batch=6, length=5):
    generator = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, length, generator=generator, dtype=torch.float64) * 3
    new = old + torch.randn(batch, length, generator=generator, dtype=torch.float64) * 0.3
    advantages = torch.randn(batch, length, generator=generator, dtype=torch.float64)
    lengths = torch.randint(1, length + 1, (batch,), generator=generator)
    mask = (torch.arange(length)[None] < lengths[:, None]).double()
    return old, new, advantages, mask


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    name=st.sampled_from(["vanilla", "gspo", "cispo"]),
    mode=st.sampled_from(
        ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
    ),
    num_micro=st.integers(2, 3),
)
def test_micro_batch_policy_losses_and_gradients_sum_to_the_mini_batch(seed, name, mode, num_micro):
    old, new, advantages, mask = _random_policy_inputs(seed)
    loss_fn = get_policy_loss(name)
    settings_ = dict(loss_agg_mode=mode, clip_ratio_low=0.2, clip_ratio_high=0.28)
    full_log_prob = new.clone().requires_grad_(True)
    full, _ = loss_fn(
        old_log_prob=old,
        log_prob=full_log_prob,
        advantages=advantages,
        response_mask=mask,
        **settings_,
    )
    full.backward()

    denominator = agg_loss_denominator(mask, mode)
    parts = [p.clone().requires_grad_(True) for p in new.chunk(num_micro)]
    total = 0.0
    for part, o, a, m in zip(
        parts,
        old.chunk(num_micro),
        advantages.chunk(num_micro),
        mask.chunk(num_micro),
        strict=True,
    ):
        micro, _ = loss_fn(
            old_log_prob=o,
            log_prob=part,
            advantages=a,
            response_mask=m,
            global_denominator=denominator,
            **settings_,
        )
        micro.backward()
        total = total + micro.item()
    assert total == pytest.approx(full.item(), rel=1e-9, abs=1e-12)
    assert torch.allclose(torch.cat([p.grad for p in parts]), full_log_prob.grad)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_every_loss_takes_the_full_keyword_set_and_reports_the_metrics(name):
    old, new, advantages, mask = _random_policy_inputs(0)
    weights = torch.full_like(mask, 0.5)
    kwargs = dict(
        old_log_prob=old,
        log_prob=new,
        advantages=advantages,
        response_mask=mask,
        loss_agg_mode="token-mean",
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
        global_denominator=None,
        some_future_argument="ignored",
    )
    torch.manual_seed(0)
    loss, metrics = get_policy_loss(name)(**kwargs)
    torch.manual_seed(0)
    weighted, _ = get_policy_loss(name)(**kwargs | {"rollout_is_weights": weights})
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert weighted.item() == pytest.approx(0.5 * loss.item())
    assert set(metrics) == {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"}
    assert all(value.dim() == 0 and not value.requires_grad for value in metrics.values())
