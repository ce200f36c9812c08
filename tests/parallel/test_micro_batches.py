"""parallel.schedule.micro_batches: the one place that cuts micro-batches and fills the last one
for pipeline parallelism."""

from __future__ import annotations

import torch

from parallel.schedule import micro_batches


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


def test_micro_batches_keep_shapes():
    batch = collated(5)
    parts = micro_batches(batch, 2)
    assert [p["input_ids"].shape[0] for p in parts] == [2, 2, 1]
    assert all(p["input_ids"].shape[1] == batch["input_ids"].shape[1] for p in parts)
    assert torch.equal(torch.cat([p["response_mask"] for p in parts]), batch["response_mask"])


def test_equal_size_micro_batches_fill_with_masked_rows():
    batch = collated(5)
    parts = micro_batches(batch, 2, equal_sizes=True)
    assert [p["input_ids"].shape[0] for p in parts] == [2, 2, 2]
    last = parts[-1]
    assert torch.equal(last["input_ids"][1], last["input_ids"][0])  # a copy of a real row...
    assert last["response_mask"][1].sum() == 0  # ...that no loss or metric counts
    assert torch.equal(last["response_mask"][0], batch["response_mask"][4])
