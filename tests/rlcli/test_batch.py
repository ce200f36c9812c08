"""The rollout batch layout and group placement the trainer relies on."""

from __future__ import annotations

import torch

from rlcli.batch import Sample, balance_groups, collate, groups_of, micro_batches, response_values


def sample(group: int, prompt: list[int], response: list[int]) -> Sample:
    logprobs = [-0.1 * (i + 1) for i in range(len(response))]
    return Sample(group, prompt, response, logprobs, "stop", item=None, score=float(group))


def test_collate_right_pads_and_indexes_responses():
    samples = [sample(0, [5, 6, 7], [8, 9]), sample(1, [5], [4, 3, 2, 1])]
    batch = collate(samples, pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9], [5, 4, 3, 2, 1]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert batch["response_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    # log-prob at position t scores token t+1: the first response token of row 0 (id 8 at
    # position 3) is scored at position 2.
    assert batch["response_index"][0, :2].tolist() == [2, 3]
    assert batch["response_index"][1].tolist() == [0, 1, 2, 3]
    assert torch.allclose(batch["engine_logprobs"][1], torch.tensor([-0.1, -0.2, -0.3, -0.4]))


def test_response_values_pick_the_scoring_positions():
    samples = [sample(0, [5, 6, 7], [8, 9]), sample(1, [5], [4, 3, 2, 1])]
    batch = collate(samples, pad_id=0)
    seq = batch["input_ids"].shape[1]
    # A fake per-position output whose value at position t is 100 * (next token id).
    per_position = (batch["input_ids"][:, 1:] * 100).float()
    assert per_position.shape == (2, seq - 1)
    values = response_values(per_position, batch["response_index"])
    assert values[0, :2].tolist() == [800.0, 900.0]
    assert values[1].tolist() == [400.0, 300.0, 200.0, 100.0]


def test_balance_groups_keeps_groups_whole_and_balances_tokens():
    samples = []
    sizes = [10, 1, 7, 3, 3, 6]
    for g, size in enumerate(sizes):
        samples += [sample(g, [1] * size, [2]) for _ in range(2)]
    parts = balance_groups(groups_of(samples), 2)
    loads = [sum(s.num_tokens for grp in part for s in grp) for part in parts]
    for part in parts:
        for grp in part:
            assert len({s.group for s in grp}) == 1 and len(grp) == 2
    assert sorted(g[0].group for part in parts for g in part) == list(range(len(sizes)))
    total = sum(loads)
    biggest_group = 2 * (max(sizes) + 1)
    assert abs(loads[0] - loads[1]) <= biggest_group and sum(loads) == total


def test_micro_batches_keep_shapes():
    samples = [sample(g, [1, 2], [3] * (g + 1)) for g in range(5)]
    batch = collate(samples, pad_id=0)
    parts = micro_batches(batch, 2)
    assert [p["input_ids"].shape[0] for p in parts] == [2, 2, 1]
    assert all(p["input_ids"].shape[1] == batch["input_ids"].shape[1] for p in parts)
    assert torch.equal(torch.cat([p["response_mask"] for p in parts]), batch["response_mask"])


def test_equal_size_micro_batches_fill_with_masked_rows():
    samples = [sample(g, [1, 2], [3] * (g + 1)) for g in range(5)]
    batch = collate(samples, pad_id=0)
    parts = micro_batches(batch, 2, equal_sizes=True)
    assert [p["input_ids"].shape[0] for p in parts] == [2, 2, 2]
    last = parts[-1]
    assert torch.equal(last["input_ids"][1], last["input_ids"][0])  # a copy of a real row...
    assert last["response_mask"][1].sum() == 0  # ...that no loss or metric counts
    assert torch.equal(last["response_mask"][0], batch["response_mask"][4])
