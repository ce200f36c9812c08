"""PromptLoader: same batches on every rank, whole epochs, and exact resume."""

from __future__ import annotations

import itertools
import json

import pytest

from rlcli.data import PromptLoader
from rlcli.errors import UserError

DATASET = [f"prompt-{i}" for i in range(10)]


def _take(loader: PromptLoader, count: int) -> list[list[str]]:
    return list(itertools.islice(loader, count))


def test_same_seed_gives_same_batches_on_every_rank():
    rank0, rank1 = PromptLoader(DATASET, 3, seed=7), PromptLoader(DATASET, 3, seed=7)
    assert _take(rank0, 12) == _take(rank1, 12)
    other_seed = PromptLoader(DATASET, 3, seed=8)
    assert _take(PromptLoader(DATASET, 3, seed=7), 12) != _take(other_seed, 12)


def test_epochs_are_shuffled_permutations():
    loader = PromptLoader(DATASET, 5, shuffle=True, seed=0, drop_last=False)
    epochs = [sum(_take(loader, 2), []) for _ in range(4)]
    for epoch in epochs:
        assert sorted(epoch) == sorted(DATASET)  # every prompt exactly once per epoch
    assert len({tuple(epoch) for epoch in epochs}) == 4  # a new order each epoch
    assert epochs[0] != DATASET


def test_drop_last_keeps_batches_full_and_does_not_repeat_within_an_epoch():
    loader = PromptLoader(DATASET, 4, seed=1, drop_last=True)
    assert loader.batches_per_epoch == 2
    batches = _take(loader, 6)
    assert all(len(batch) == 4 for batch in batches)
    for epoch_start in (0, 2, 4):
        epoch = batches[epoch_start] + batches[epoch_start + 1]
        assert len(set(epoch)) == 8
    assert loader.epoch == 2


def test_no_shuffle_keeps_file_order_and_short_last_batch():
    loader = PromptLoader(DATASET, 4, shuffle=False, drop_last=False)
    assert loader.batches_per_epoch == 3
    assert _take(loader, 4) == [DATASET[0:4], DATASET[4:8], DATASET[8:10], DATASET[0:4]]


@pytest.mark.parametrize("steps_before_save", [0, 1, 2, 3, 5, 7])
def test_resume_continues_with_exactly_the_same_batches(steps_before_save):
    uninterrupted = PromptLoader(DATASET, 4, seed=3, drop_last=True)
    expected = _take(uninterrupted, steps_before_save + 5)[steps_before_save:]

    first_run = PromptLoader(DATASET, 4, seed=3, drop_last=True)
    _take(first_run, steps_before_save)
    state = json.loads(json.dumps(first_run.state_dict()))  # what a checkpoint holds

    resumed = PromptLoader(DATASET, 4, seed=3, drop_last=True)
    resumed.load_state_dict(state)
    assert _take(resumed, 5) == expected


def test_resume_with_a_new_batch_size_continues_at_the_same_sample():
    first_run = PromptLoader(DATASET, 4, seed=5, drop_last=False)
    seen = sum(_take(first_run, 1), [])
    resumed = PromptLoader(DATASET, 3, seed=5, drop_last=False)
    resumed.load_state_dict(first_run.state_dict())
    rest = sum(_take(resumed, 2), [])
    assert len(rest) == 6 and sorted(seen + rest) == sorted(DATASET)


def test_resume_with_other_seed_or_data_is_a_user_error():
    state = PromptLoader(DATASET, 4, seed=1).state_dict()
    with pytest.raises(UserError, match="same data files and data seed"):
        PromptLoader(DATASET, 4, seed=2).load_state_dict(state)
    with pytest.raises(UserError, match="dataset size"):
        PromptLoader(DATASET[:9], 4, seed=1).load_state_dict(state)


def test_batch_larger_than_dataset_or_empty_dataset_is_a_user_error():
    with pytest.raises(UserError, match="batch_size=11 is larger than the dataset"):
        PromptLoader(DATASET, 11, drop_last=True)
    with pytest.raises(UserError, match="empty"):
        PromptLoader([], 1)
    assert len(next(PromptLoader(DATASET, 11, drop_last=False))) == 10
