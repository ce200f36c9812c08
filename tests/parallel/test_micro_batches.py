"""parallel.micro_batches: the one place that cuts micro-batches and fills the last one
for pipeline parallelism."""

from __future__ import annotations

import torch

from parallel.micro_batches import ROW_KEY, micro_batches


def collated(num_rows: int) -> dict[str, torch.Tensor]:
    """Right-padded rows: row g has a 2-token prompt and g + 1 response tokens."""
    input_ids = torch.zeros((num_rows, 2 + num_rows), dtype=torch.long)
    response_mask = torch.zeros((num_rows, num_rows))
    for g in range(num_rows):
        input_ids[g, : 3 + g] = torch.arange(1, 4 + g)
        response_mask[g, : g + 1] = 1.0
    return {
        "input_ids": input_ids,
        "attention_mask": (input_ids > 0).long(),
        "response_mask": response_mask,
    }


def test_micro_batches_keep_order_and_trim_to_their_own_longest_row():
    batch = collated(5)
    parts = micro_batches(batch, 2)
    assert [p["input_ids"].shape[0] for p in parts] == [2, 2, 1]
    # Rows 0-1 hold 3-4 tokens and 1-2 response tokens; row 4 holds 7 and 5.
    assert [p["input_ids"].shape[1] for p in parts] == [4, 6, 7]
    assert [p["response_mask"].shape[1] for p in parts] == [2, 4, 5]
    for part, start in zip(parts, (0, 2, 4), strict=True):
        rows = slice(start, start + part["input_ids"].shape[0])
        width = part["input_ids"].shape[1]
        assert torch.equal(part["input_ids"], batch["input_ids"][rows, :width])
        assert batch["attention_mask"][rows, width:].sum() == 0  # only padding was cut
        assert batch["response_mask"][rows, part["response_mask"].shape[1] :].sum() == 0


def test_token_budget_groups_similar_lengths_within_the_budget():
    batch = collated(6)  # row g: 3 + g tokens
    batch[ROW_KEY] = torch.arange(6)
    parts = micro_batches(batch, 1, max_tokens=16)
    # Longest first: 8 and 7 (2 x 8 = 16; a third row would make 24), then 6 and 5 (a third
    # row: 3 x 6 = 18), then 4 and 3.
    assert [p[ROW_KEY].tolist() for p in parts] == [[5, 4], [3, 2], [1, 0]]
    for part in parts:
        assert part["input_ids"].numel() <= 16
        rows = part[ROW_KEY]
        width = part["input_ids"].shape[1]
        assert width == int(batch["attention_mask"][rows].sum(dim=1).max())
        assert torch.equal(part["input_ids"], batch["input_ids"][rows, :width])
        assert torch.equal(
            part["response_mask"], batch["response_mask"][rows, : part["response_mask"].shape[1]]
        )
    # Every row exactly once.
    assert sorted(torch.cat([p[ROW_KEY] for p in parts]).tolist()) == list(range(6))


def test_token_budget_gives_a_longer_row_its_own_micro_batch():
    batch = collated(3)  # 3, 4, 5 tokens
    batch[ROW_KEY] = torch.arange(3)
    parts = micro_batches(batch, 8, max_tokens=4)
    assert [p[ROW_KEY].tolist() for p in parts] == [[2], [1], [0]]


def test_token_budget_under_pipeline_parallelism_keeps_one_shape():
    batch = collated(5)  # S = 7
    parts = micro_batches(batch, 1, equal_sizes=True, max_tokens=15)  # 15 // 7 = 2 rows
    assert {tuple(p["input_ids"].shape) for p in parts} == {(2, 7)}
    assert len(parts) == 3


def test_equal_size_micro_batches_fill_with_masked_rows():
    batch = collated(5)
    parts = micro_batches(batch, 2, equal_sizes=True)
    assert [p["input_ids"].shape[0] for p in parts] == [2, 2, 2]
    last = parts[-1]
    assert torch.equal(last["input_ids"][1], last["input_ids"][0])  # a copy of a real row...
    assert last["response_mask"][1].sum() == 0  # ...that no loss or metric counts
    assert torch.equal(last["response_mask"][0], batch["response_mask"][4])


def test_packing_fills_micro_batches_by_real_tokens_first_fit_decreasing():
    batch = collated(6)  # row g: 3 + g real tokens, S = 8
    batch[ROW_KEY] = torch.arange(6)
    parts = micro_batches(batch, 1, max_tokens=12, pack=True, equal_sizes=True)
    # Longest first into the first micro-batch with room: 8, 7 and 6 open one each, 5 joins 7
    # (12), 4 joins 8 (12), 3 only fits beside 6 (9).
    assert [p[ROW_KEY].tolist() for p in parts] == [[5, 1], [4, 2], [3, 0]]
    for part in parts:
        assert int(part["attention_mask"].sum()) <= 12
        width = part["input_ids"].shape[1]  # trimmed even with equal_sizes: packing needs no shape
        assert width == int(part["attention_mask"].sum(dim=1).max())
    assert sorted(torch.cat([p[ROW_KEY] for p in parts]).tolist()) == list(range(6))


def test_packing_budget_defaults_to_what_a_fixed_micro_batch_computes():
    batch = collated(6)  # 3 + 4 + ... + 8 = 33 real tokens, S = 8
    parts = micro_batches(batch, 2, pack=True)  # 2 rows x 8 = 16 tokens: 8+7, 6+5+4, 3
    assert [int(p["attention_mask"].sum()) for p in parts] == [15, 15, 3]
    longer = micro_batches(batch, 8, pack=True, max_tokens=4)  # every row above the budget
    assert [p["input_ids"].shape[0] for p in longer] == [1] * 6
