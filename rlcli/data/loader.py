"""A deterministic, resumable prompt loader: the same global batches on every rank.

Every rank builds ``PromptLoader`` with the same dataset and seed and draws the same global
batch at every step; each rollout replica then takes its own slice. The order of epoch ``e`` is
a permutation drawn from ``numpy.random.default_rng([seed, e])``, so it depends only on
(seed, epoch, dataset size) and a resumed run needs no RNG state, only (epoch, position).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Generic, TypeVar

import numpy as np

from rlcli.errors import UserError

T = TypeVar("T")


class PromptLoader(Generic[T]):
    """Endless iterator over batches (lists of dataset items), epoch after epoch.

    ``position`` counts the samples of the current epoch already handed out, so a run
    resumed with a different ``batch_size`` still continues where it stopped.
    """

    def __init__(
        self,
        dataset: Sequence[T],
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
    ) -> None:
        if batch_size < 1:
            raise UserError(f"batch_size must be >= 1, got {batch_size}")
        if len(dataset) == 0:
            raise UserError("the prompt dataset is empty")
        if drop_last and batch_size > len(dataset):
            raise UserError(
                f"batch_size={batch_size} is larger than the dataset ({len(dataset)} prompts) "
                "and drop_last is set: lower the batch size or add prompts"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.position = 0
        self._order = self._epoch_order(0)

    @property
    def batches_per_epoch(self) -> int:
        """Number of batches in a full epoch."""
        full, rest = divmod(len(self.dataset), self.batch_size)
        return full if self.drop_last or rest == 0 else full + 1

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.dataset))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.dataset))

    def _start_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.position = 0
        self._order = self._epoch_order(epoch)

    def __iter__(self) -> Iterator[list[T]]:
        return self

    def __next__(self) -> list[T]:
        remaining = len(self.dataset) - self.position
        if remaining == 0 or (self.drop_last and remaining < self.batch_size):
            self._start_epoch(self.epoch + 1)
        end = min(self.position + self.batch_size, len(self.dataset))
        batch = [self.dataset[int(i)] for i in self._order[self.position : end]]
        self.position = end
        return batch

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint stores; ``load_state_dict`` continues with the same next batch."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "dataset_size": len(self.dataset),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore (epoch, position); the seed, shuffle and dataset size must match."""
        saved = (state["seed"], state["shuffle"], state["dataset_size"])
        current = (self.seed, self.shuffle, len(self.dataset))
        if saved != current:
            raise UserError(
                "the checkpoint's prompt order does not match this run: saved "
                f"(seed, shuffle, dataset size) = {saved}, now {current}; resume with the same "
                "data files and data seed, or start a fresh run"
            )
        self._start_epoch(int(state["epoch"]))
        self.position = int(state["position"])
