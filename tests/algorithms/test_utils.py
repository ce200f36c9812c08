import math

import numpy as np
import pytest
import torch

from algorithms import (
    entropy_from_logits,
    group_ids_to_tensor,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)

VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, float("nan"), float("inf")]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])


def test_masked_sum_and_mean_ignore_padding_even_nan():
    assert masked_sum(VALUES, MASK).item() == 10.0
    assert masked_mean(VALUES, MASK).item() == pytest.approx(2.5)
    assert masked_mean(VALUES, MASK, dim=-1).tolist() == pytest.approx([2.0, 4.0])


def test_masked_var_is_unbiased_by_default():
    # elements 1, 2, 3, 4: mean 2.5, squared deviations sum 5.0
    assert masked_var(VALUES, MASK).item() == pytest.approx(5.0 / 3)
    assert masked_var(VALUES, MASK, unbiased=False).item() == pytest.approx(5.0 / 4)
    with pytest.raises(ValueError, match="at least 2"):
        masked_var(VALUES, torch.tensor([[1, 0, 0], [0, 0, 0]]))


def test_masked_whiten_gives_zero_mean_unit_unbiased_variance():
    whitened = masked_whiten(VALUES, MASK)
    expected = (torch.tensor([1.0, 2.0, 3.0, 4.0]) - 2.5) / math.sqrt(5.0 / 3 + 1e-8)
    assert torch.allclose(whitened[MASK.bool()], expected)
    rescaled = masked_whiten(VALUES, MASK, shift_mean=False)
    assert torch.allclose(rescaled[MASK.bool()], expected + 2.5)


def test_group_ids_from_tensor_strings_and_lists():
    assert group_ids_to_tensor(torch.tensor([7, 3, 7, 9])).tolist() == [1, 0, 1, 2]
    assert group_ids_to_tensor(np.array(["u2", "u1", "u2"], dtype=object)).tolist() == [0, 1, 0]
    assert group_ids_to_tensor([5, 5, 1]).tolist() == [0, 0, 1]


def test_entropy_matches_float64_reference_and_survives_huge_logits():
    logits = torch.randn(4, 7, 33, generator=torch.Generator().manual_seed(0)) * 3
    probs = torch.softmax(logits.double(), dim=-1)
    reference = -(probs * probs.log()).sum(-1)
    assert torch.allclose(entropy_from_logits(logits).double(), reference, atol=1e-5)

    # Two equal huge logits and the rest far below: entropy log(2); exp(1e4) would overflow.
    huge = torch.tensor([[1e4, 1e4, -1e4, 0.0]])
    assert entropy_from_logits(huge).item() == pytest.approx(math.log(2), abs=1e-5)
    uniform = torch.zeros(1, 10)
    assert entropy_from_logits(uniform).item() == pytest.approx(math.log(10), abs=1e-6)
