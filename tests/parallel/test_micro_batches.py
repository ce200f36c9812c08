"""parallel.micro_batches: the one place that cuts micro-batches and fills the last one
for pipeline parallelism."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from parallel.micro_batches import micro_batches
from parallel.step_types import MicroBatch, sequence_field


def collated(num_rows: int) -> MicroBatch:
    """Right-padded rows: row g has a 2-token prompt and g + 1 response tokens."""
    input_ids = torch.zeros((num_rows, 2 + num_rows), dtype=torch.long)
    response_mask = torch.zeros((num_rows, num_rows))
    for g in range(num_rows):
        input_ids[g, : 3 + g] = torch.arange(1, 4 + g)
        response_mask[g, : g + 1] = 1.0
    return MicroBatch(
        input_ids=input_ids,
        attention_mask=(input_ids > 0).long(),
        response_mask=response_mask,
        row_index=torch.arange(num_rows),
    )


def test_micro_batches_keep_order_and_trim_to_their_own_longest_row():
    batch = collated(5)
    parts = micro_batches(batch, 2)
    assert [p.input_ids.shape[0] for p in parts] == [2, 2, 1]
    # Rows 0-1 hold 3-4 tokens and 1-2 response tokens; row 4 holds 7 and 5.
    assert [p.input_ids.shape[1] for p in parts] == [4, 6, 7]
    assert [p.response_mask.shape[1] for p in parts] == [2, 4, 5]
    for part, start in zip(parts, (0, 2, 4), strict=True):
        rows = slice(start, start + part.input_ids.shape[0])
        width = part.input_ids.shape[1]
        assert torch.equal(part.input_ids, batch.input_ids[rows, :width])
        assert batch.attention_mask[rows, width:].sum() == 0  # only padding was cut
        assert batch.response_mask[rows, part.response_mask.shape[1] :].sum() == 0


def test_token_budget_groups_similar_lengths_within_the_budget():
    batch = collated(6)  # row g: 3 + g tokens
    parts = micro_batches(batch, 1, max_tokens=16)
    # Longest first: 8 and 7 (2 x 8 = 16; a third row would make 24), then 6 and 5 (a third
    # row: 3 x 6 = 18), then 4 and 3.
    assert [p.row_index.tolist() for p in parts] == [[5, 4], [3, 2], [1, 0]]
    for part in parts:
        assert part.input_ids.numel() <= 16
        rows = part.row_index
        width = part.input_ids.shape[1]
        assert width == int(batch.attention_mask[rows].sum(dim=1).max())
        assert torch.equal(part.input_ids, batch.input_ids[rows, :width])
        assert torch.equal(
            part.response_mask, batch.response_mask[rows, : part.response_mask.shape[1]]
        )
    # Every row exactly once.
    assert sorted(torch.cat([p.row_index for p in parts]).tolist()) == list(range(6))


def test_token_budget_gives_a_longer_row_its_own_micro_batch():
    batch = collated(3)  # 3, 4, 5 tokens
    parts = micro_batches(batch, 8, max_tokens=4)
    assert [p.row_index.tolist() for p in parts] == [[2], [1], [0]]


def test_token_budget_under_pipeline_parallelism_keeps_one_shape():
    batch = collated(5)  # S = 7
    parts = micro_batches(batch, 1, equal_sizes=True, max_tokens=15)  # 15 // 7 = 2 rows
    assert {tuple(p.input_ids.shape) for p in parts} == {(2, 7)}
    assert len(parts) == 3


def test_equal_size_micro_batches_fill_with_masked_rows():
    batch = collated(5)
    parts = micro_batches(batch, 2, equal_sizes=True)
    assert [p.input_ids.shape[0] for p in parts] == [2, 2, 2]
    last = parts[-1]
    assert torch.equal(last.input_ids[1], last.input_ids[0])  # a copy of a real row...
    assert last.response_mask[1].sum() == 0  # ...that no loss or metric counts
    assert torch.equal(last.response_mask[0], batch.response_mask[4])


def test_packing_fills_micro_batches_by_real_tokens_first_fit_decreasing():
    batch = collated(6)  # row g: 3 + g real tokens, S = 8
    parts = micro_batches(batch, 1, max_tokens=12, pack=True, equal_sizes=True)
    # Longest first into the first micro-batch with room: 8, 7 and 6 open one each, 5 joins 7
    # (12), 4 joins 8 (12), 3 only fits beside 6 (9).
    assert [p.row_index.tolist() for p in parts] == [[5, 1], [4, 2], [3, 0]]
    for part in parts:
        assert int(part.attention_mask.sum()) <= 12
        width = part.input_ids.shape[1]  # trimmed even with equal_sizes: packing needs no shape
        assert width == int(part.attention_mask.sum(dim=1).max())
    assert sorted(torch.cat([p.row_index for p in parts]).tolist()) == list(range(6))


def test_packing_budget_defaults_to_what_a_fixed_micro_batch_computes():
    batch = collated(6)  # 3 + 4 + ... + 8 = 33 real tokens, S = 8
    parts = micro_batches(batch, 2, pack=True)  # 2 rows x 8 = 16 tokens: 8+7, 6+5+4, 3
    assert [int(p.attention_mask.sum()) for p in parts] == [15, 15, 3]
    longer = micro_batches(batch, 8, pack=True, max_tokens=4)  # every row above the budget
    assert [p.input_ids.shape[0] for p in longer] == [1] * 6


@dataclass(kw_only=True)
class RoutedRows(MicroBatch):
    """A micro-batch with a per-token input micro_batches has never heard of: one field."""

    routing: torch.Tensor = sequence_field()  # [mb, S, 2]: the experts chosen for each token


def routed(num_rows: int) -> RoutedRows:
    rows = collated(num_rows)
    tokens = torch.arange(rows.input_ids.numel()).view_as(rows.input_ids)
    routing = torch.stack([tokens, -tokens], dim=-1) * rows.attention_mask[..., None]
    return RoutedRows(**rows.filled(), routing=routing)


@pytest.mark.parametrize(
    "cut",
    [
        {"micro_batch_size": 2},
        {"micro_batch_size": 1, "max_tokens": 16},
        {"micro_batch_size": 2, "pack": True},
        {"micro_batch_size": 2, "equal_sizes": True},
    ],
)
def test_a_new_per_token_field_is_cut_trimmed_and_filled_with_its_rows(cut):
    batch = routed(5)
    parts = micro_batches(batch, **cut)
    assert all(type(part) is RoutedRows for part in parts)
    for part in parts:
        rows, width = part.row_index, part.input_ids.shape[1]
        # The new field keeps its rows, its token axis cut exactly like input_ids'.
        assert part.routing.shape == (*part.input_ids.shape, 2)
        assert torch.equal(part.routing, batch.routing[rows, :width])
    if cut.get("equal_sizes"):  # the last micro-batch's filler row copies the field too
        assert torch.equal(parts[-1].routing[1], parts[-1].routing[0])
        assert parts[-1].response_mask[1].sum() == 0


def test_a_field_without_a_declared_axis_is_refused():
    @dataclass(kw_only=True)
    class Undeclared(MicroBatch):
        features: torch.Tensor

    with pytest.raises(TypeError, match="Undeclared.features declares no axis"):
        Undeclared(input_ids=torch.ones(1, 2), attention_mask=torch.ones(1, 2), features=None)
