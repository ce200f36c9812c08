"""Preference pairs as token ids, and right padding: the data side of reward-model training
(``parallel.reward_training``), kept free of megatron imports so data code can build them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from parallel.mesh import Mesh


@dataclass(frozen=True)
class TokenizedPairs:
    """Preference pairs as token ids: ``chosen[i]`` (prompt + preferred response) beats
    ``rejected[i]`` (the same prompt + the other response); ``margins[i]``, when given, is how
    far the chosen score should lead (``algorithms.reward_model.bradley_terry_loss``)."""

    chosen: list[list[int]]
    rejected: list[list[int]]
    margins: list[float] | None = None

    def __post_init__(self) -> None:
        if len(self.chosen) != len(self.rejected):
            raise ValueError(f"{len(self.chosen)} chosen but {len(self.rejected)} rejected")
        if self.margins is not None and len(self.margins) != len(self.chosen):
            raise ValueError(f"{len(self.margins)} margins for {len(self.chosen)} pairs")

    def __len__(self) -> int:
        return len(self.chosen)

    def select(self, indices: Sequence[int]) -> TokenizedPairs:
        return TokenizedPairs(
            [self.chosen[i] for i in indices],
            [self.rejected[i] for i in indices],
            None if self.margins is None else [self.margins[i] for i in indices],
        )

    def share(self, mesh: Mesh) -> TokenizedPairs:
        """This data-parallel rank's contiguous share; the length must divide by ``mesh.dp``."""
        if len(self) % mesh.dp:
            raise ValueError(f"{len(self)} pairs do not split evenly over dp={mesh.dp} replicas")
        size = len(self) // mesh.dp
        return self.select(range(mesh.dp_rank * size, (mesh.dp_rank + 1) * size))


def pad_sequences(
    sequences: Sequence[Sequence[int]], pad_token_id: int | None, length: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids`` and ``attention_mask`` ``[B, max(length, longest)]``."""
    width = max([length, *map(len, sequences)])
    input_ids = torch.full((len(sequences), width), pad_token_id or 0, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, tokens in enumerate(sequences):
        input_ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        attention_mask[row, : len(tokens)] = 1
    return input_ids, attention_mask
