import numpy as np
import pytest
import torch

from algorithms import compute_value_loss, filter_groups, overlong_penalty


def test_clipped_value_loss_hand_computed():
    vpreds = torch.tensor([[1.0, 0.0, 5.0]], requires_grad=True)
    values = torch.tensor([[0.5, 0.0, 0.0]])
    returns = torch.tensor([[2.0, 1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, metrics = compute_value_loss(vpreds, returns, values, mask, cliprange_value=0.2)
    # token 0: max((1 - 2)^2, (0.7 - 2)^2) = 1.69 (clipped wins); token 1: 1; token 2 is padding
    assert loss.item() == pytest.approx(0.5 * (1.69 + 1.0) / 2)
    assert metrics["vf_clipfrac"].item() == pytest.approx(0.5)
    loss.backward()
    # the clipped branch is constant in vpreds (0.7 is the clip bound): no gradient for token 0
    assert vpreds.grad[0].tolist() == pytest.approx([0.0, 0.5 * 2 * (0 - 1) / 2, 0.0])

    seq_loss, _ = compute_value_loss(
        vpreds, returns, values, mask, 0.2, loss_agg_mode="seq-mean-token-sum"
    )
    assert seq_loss.item() == pytest.approx(0.5 * (1.69 + 1.0))


def test_filter_groups_keeps_only_groups_with_varying_metric():
    metric = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 2.0])
    groups = np.array(["a", "a", "a", "b", "c", "c", "d"], dtype=object)
    keep, stats = filter_groups(metric, groups)
    # a varies: kept; b and d are singletons: dropped; c is constant: dropped
    assert keep.tolist() == [True, True, True, False, False, False, False]
    assert stats == {"kept_groups": 1, "total_groups": 4, "kept_samples": 3, "total_samples": 7}
    assert keep.dtype == torch.bool


def test_filter_groups_treats_round_off_equal_values_as_constant():
    metric = torch.tensor([0.1, 0.1, 0.1, 0.1 + 1e-7], dtype=torch.float64)
    keep, stats = filter_groups(metric, torch.tensor([0, 0, 0, 1]))
    assert not keep.any() and stats["kept_groups"] == 0
    keep, _ = filter_groups(torch.tensor([0.1, 0.1 + 1e-7]), [3, 3])
    assert keep.all()


def test_overlong_penalty_is_linear_inside_the_buffer():
    lengths = torch.tensor([10, 16, 18, 20, 22])
    penalty = overlong_penalty(lengths, max_response_length=20, buffer_len=4, penalty_factor=1.0)
    assert penalty.tolist() == pytest.approx([0.0, 0.0, -0.5, -1.0, -1.5])
    assert overlong_penalty(lengths, 20, 4, penalty_factor=2.0)[2].item() == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(lengths, 20, 0)
