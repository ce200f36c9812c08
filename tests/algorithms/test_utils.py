import math

import numpy as np
import pytest
import torch

from algorithms import (
    group_ids_to_tensor,
    masked_mean,
    masked_sum,
    masked_whiten,
)

VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, float("nan"), float("inf")]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])


def test_masked_sum_and_mean_ignore_padding_even_nan():
    assert masked_sum(VALUES, MASK).item() == 10.0
    assert masked_mean(VALUES, MASK).item() == pytest.approx(2.5)
    assert masked_mean(VALUES, MASK, dim=-1).tolist() == pytest.approx([2.0, 4.0])


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
