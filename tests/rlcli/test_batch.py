"""The rollout batch layout and group placement the trainer relies on."""

from __future__ import annotations

import pytest
import torch

from rlcli.rollout.batch import (
    Sample,
    balance_groups,
    collate,
    groups_of,
    response_values,
    take_dp_share,
)


def sample(group: int, prompt: list[int], response: list[int]) -> Sample:
    logprobs = [-0.1 * (i + 1) for i in range(len(response))]
    return Sample(group, prompt, response, logprobs, "stop", item=None, score=float(group))


def test_collate_right_pads_and_indexes_responses():
    samples = [sample(0, [5, 6, 7], [8, 9]), sample(1, [5], [4, 3, 2, 1])]
    batch = collate(samples, pad_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 4, 3, 2, 1]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert batch.response_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert batch.loss_mask.tolist() == batch.response_mask.tolist()  # single-turn: all generated
    # log-prob at position t scores token t+1: the first response token of row 0 (id 8 at
    # position 3) is scored at position 2.
    assert batch.response_index[0, :2].tolist() == [2, 3]
    assert batch.response_index[1].tolist() == [0, 1, 2, 3]
    assert torch.allclose(batch.engine_log_probs[1], torch.tensor([-0.1, -0.2, -0.3, -0.4]))
    assert batch.old_log_probs is None
    with pytest.raises(RuntimeError, match="no advantages"):
        batch.require("advantages")


def test_loss_mask_marks_only_generated_tokens():
    tool_turn = sample(0, [5, 6], [8, 9, 30, 31, 10])
    tool_turn.loss_mask = [1, 1, 0, 0, 1]  # two tool tokens between two generated runs
    batch = collate([tool_turn, sample(1, [5], [4])], pad_id=0)
    assert batch.response_mask.tolist() == [[1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert batch.loss_mask.tolist() == [[1, 1, 0, 0, 1], [1, 0, 0, 0, 0]]


def test_select_slices_every_filled_field_together():
    batch = collate([sample(g, [1, 2], [3, g + 4]) for g in range(3)], pad_id=0)
    batch.advantages = torch.arange(6.0).view(3, 2)
    picked = batch.select(torch.tensor([False, True, True]))
    assert picked.group_index.tolist() == [1, 2]
    assert picked.advantages.tolist() == [[2.0, 3.0], [4.0, 5.0]]
    assert picked.input_ids[:, -1].tolist() == [5, 6] and picked.values is None


def test_response_values_pick_the_scoring_positions():
    samples = [sample(0, [5, 6, 7], [8, 9]), sample(1, [5], [4, 3, 2, 1])]
    batch = collate(samples, pad_id=0)
    seq = batch.input_ids.shape[1]
    # A fake per-position output whose value at position t is 100 * (next token id).
    per_position = (batch.input_ids[:, 1:] * 100).float()
    assert per_position.shape == (2, seq - 1)
    values = response_values(per_position, batch.response_index)
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
    # By hand, longest group first onto the lighter part (group tokens 22, 16, 14, 8, 8, 4):
    # 22 -> A, 16 -> B, 14 -> B (30), 8 -> A (30), 8 -> A (tie: fewer groups, then index), 4 -> B
    assert loads == [38, 34] and sum(loads) == sum(s.num_tokens for s in samples)


def test_take_dp_share_gives_each_rank_whole_groups_and_all_groups_once():
    samples = [sample(g, [1] * (g + 1), [2, 3]) for g in range(5) for _ in range(2)]
    shares = [take_dp_share(samples, 2, rank) for rank in range(2)]
    assert {fewest for _, fewest in shares} == {2}  # 5 groups over 2 ranks: 3 and 2
    groups = [s.group for mine, _ in shares for s in mine]
    assert sorted(groups) == sorted(s.group for s in samples)
    for mine, _ in shares:
        assert all(sum(s.group == g for s in mine) == 2 for g in {s.group for s in mine})
