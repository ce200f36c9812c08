import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from algorithms import LOSS_AGG_MODES, agg_loss, agg_loss_denominator

LOSS = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 5.0, 0.0, 0.0], [7.0, 0.0, 0.0, 0.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", (1 + 2 + 3 + 4 + 5) / 5),
        ("seq-mean-token-sum", (6 + 9) / 2),  # the all-padding row is not a sequence
        ("seq-mean-token-mean", (2 + 4.5) / 2),
        ("seq-mean-token-sum-norm", (6 + 9) / 2 / 4),  # / response_len
    ],
)
def test_hand_computed_modes(mode, expected):
    assert agg_loss(LOSS, MASK, mode).item() == pytest.approx(expected)


def test_sum_norm_with_constant_length_and_unknown_mode():
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", norm_length=10).item() == pytest.approx(
        15 / 2 / 10
    )
    with pytest.raises(ValueError, match="token-mean"):
        agg_loss(LOSS, MASK, "token-sum")


def test_all_padding_batch_gives_zero_not_nan():
    for mode in LOSS_AGG_MODES:
        assert agg_loss(LOSS, torch.zeros_like(MASK), mode).item() == 0.0


def _random_batch(seed: int, batch: int, length: int):
    generator = torch.Generator().manual_seed(seed)
    loss = torch.randn(batch, length, generator=generator, dtype=torch.float64)
    lengths = torch.randint(0, length + 1, (batch,), generator=generator)
    mask = (torch.arange(length)[None] < lengths[:, None]).to(torch.float64)
    return loss, mask


def _loop_reference(loss, mask, mode):
    """Independent per-sequence loop."""
    rows = [(loss[i][mask[i] > 0]) for i in range(loss.shape[0])]
    rows = [row for row in rows if row.numel() > 0]
    if not rows:
        return 0.0
    if mode == "token-mean":
        return float(sum(row.sum() for row in rows) / sum(row.numel() for row in rows))
    if mode == "seq-mean-token-sum":
        return float(sum(row.sum() for row in rows) / len(rows))
    if mode == "seq-mean-token-mean":
        return float(sum(row.mean() for row in rows) / len(rows))
    return float(sum(row.sum() / loss.shape[1] for row in rows) / len(rows))


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    batch=st.integers(1, 8),
    length=st.integers(1, 7),
    mode=st.sampled_from(LOSS_AGG_MODES),
)
def test_modes_agree_with_a_loop_over_sequences(seed, batch, length, mode):
    loss, mask = _random_batch(seed, batch, length)
    assert agg_loss(loss, mask, mode).item() == pytest.approx(_loop_reference(loss, mask, mode))


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    batch=st.integers(2, 9),
    num_micro=st.integers(1, 4),
    mode=st.sampled_from(LOSS_AGG_MODES),
)
def test_micro_batch_losses_and_gradients_sum_to_the_full_batch(seed, batch, num_micro, mode):
    loss_input, mask = _random_batch(seed, batch, 6)
    weights = loss_input.clone().requires_grad_(True)
    full = agg_loss(weights**2, mask, mode)
    (full_grad,) = torch.autograd.grad(full, weights)

    denominator = agg_loss_denominator(mask, mode)
    micro_weights = [w.clone().requires_grad_(True) for w in weights.detach().chunk(num_micro)]
    total = sum(
        agg_loss(w**2, m, mode, global_denominator=denominator)
        for w, m in zip(micro_weights, mask.chunk(num_micro), strict=True)
    )
    total.backward()
    assert total.item() == pytest.approx(full.item(), rel=1e-12, abs=1e-12)
    assert torch.allclose(torch.cat([w.grad for w in micro_weights]), full_grad)


def test_denominators_are_documented_counts():
    assert agg_loss_denominator(MASK, "token-mean").item() == 5
    assert agg_loss_denominator(MASK, "seq-mean-token-sum").item() == 2
    assert agg_loss_denominator(MASK, "seq-mean-token-mean").item() == 2
    assert agg_loss_denominator(MASK, "seq-mean-token-sum-norm").item() == 8
    assert agg_loss_denominator(MASK, "seq-mean-token-sum-norm", norm_length=100).item() == 200
