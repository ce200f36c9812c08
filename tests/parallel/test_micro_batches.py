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
