"""The rollout batch: samples from the engine -> right-padded tensors the trainer feeds Megatron.

Layout (``B`` sequences, ``S`` = longest prompt + response, ``R`` = longest response):

- ``input_ids [B, S]``: prompt then response, right-padded, so plain causal attention is exact
  and position ids are ``arange(S)``.
- ``attention_mask [B, S]``: 1 on real tokens.
- ``response_index [B, R]``: for response token ``j`` of sequence ``b``, the position in the
  Megatron log-prob output ``[B, S-1]`` that scores it (``prompt_len - 1 + j``); padding points at 0.
- ``response_mask [B, R]``: 1 on real response tokens. Every algorithm works on ``[B, R]``.

Groups (all ``n`` samples of one prompt) stay whole: data-parallel ranks receive whole groups,
balanced by token count (``take_dp_share``), and mini-batches split along groups too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from rlcli.data import PromptItem


@dataclass
class Sample:
    """One sampled response and everything the step computes about it."""

    group: int  # which prompt of this step it answers
    prompt_ids: list[int]
    response_ids: list[int]
    engine_logprobs: list[float]
    finish_reason: str
    item: PromptItem | None  # data_source, ground_truth, extra_info (None for SFT pairs)
    score: float = 0.0
    extras: dict[str, Any] = field(default_factory=dict)  # the reward function's extra fields
    reward_baseline: float = 0.0  # ReMax: the score of this prompt's greedy answer

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


def collate(samples: list[Sample], pad_id: int) -> dict[str, torch.Tensor]:
    """Tensors for a list of samples (see the module docstring for the layout)."""
    batch = len(samples)
    seq_len = max(s.num_tokens for s in samples)
    resp_len = max(1, max(len(s.response_ids) for s in samples))
    input_ids = torch.full((batch, seq_len), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, seq_len), dtype=torch.long)
    response_index = torch.zeros((batch, resp_len), dtype=torch.long)
    response_mask = torch.zeros((batch, resp_len), dtype=torch.float32)
    engine_logprobs = torch.zeros((batch, resp_len), dtype=torch.float32)
    for row, s in enumerate(samples):
        tokens = s.prompt_ids + s.response_ids
        input_ids[row, : len(tokens)] = torch.tensor(tokens)
        attention_mask[row, : len(tokens)] = 1
        n_resp = len(s.response_ids)
        response_index[row, :n_resp] = torch.arange(n_resp) + len(s.prompt_ids) - 1
        response_mask[row, :n_resp] = 1.0
        engine_logprobs[row, :n_resp] = torch.tensor(
            s.engine_logprobs[:n_resp], dtype=torch.float32
        )
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "response_index": response_index,
        "response_mask": response_mask,
        "engine_logprobs": engine_logprobs,
        "group_index": torch.tensor([s.group for s in samples], dtype=torch.long),
        "scores": torch.tensor([s.score for s in samples], dtype=torch.float32),
        "reward_baselines": torch.tensor([s.reward_baseline for s in samples], dtype=torch.float32),
    }


def response_values(per_position: torch.Tensor, response_index: torch.Tensor) -> torch.Tensor:
    """Pick ``[B, R]`` response-aligned values out of a ``[B, S-1]`` per-position tensor."""
    return torch.gather(per_position, 1, response_index.to(per_position.device))


def groups_of(samples: list[Sample]) -> list[list[Sample]]:
    """Samples grouped by prompt, in order of first appearance."""
    groups: dict[int, list[Sample]] = {}
    for s in samples:
        groups.setdefault(s.group, []).append(s)
    return list(groups.values())


def balance_groups(groups: list[list[Sample]], num_parts: int) -> list[list[list[Sample]]]:
    """Split whole groups into ``num_parts`` parts with token counts as equal as possible.

    Longest-processing-time first: the largest remaining group goes to the lightest part. Parts
    differ by at most one group's tokens; the result is deterministic for the same input.
    """
    parts: list[list[list[Sample]]] = [[] for _ in range(num_parts)]
    loads = [0] * num_parts
    order = sorted(range(len(groups)), key=lambda i: (-sum(s.num_tokens for s in groups[i]), i))
    for i in order:
        lightest = min(range(num_parts), key=lambda p: (loads[p], len(parts[p]), p))
        parts[lightest].append(groups[i])
        loads[lightest] += sum(s.num_tokens for s in groups[i])
    return parts


def take_dp_share(samples: list[Sample], dp: int, dp_rank: int) -> tuple[list[Sample], int]:
    """This data-parallel rank's whole groups of the step's samples, and the fewest groups any
    DP rank holds. Every rank holds the same samples, so every rank computes the same split."""
    parts = balance_groups(groups_of(samples), dp)
    return [s for group in parts[dp_rank] for s in group], min(len(part) for part in parts)


def split_evenly(items: list[Any], num_chunks: int) -> list[list[Any]]:
    """``num_chunks`` contiguous chunks whose sizes differ by at most one (some may be empty)."""
    base, extra = divmod(len(items), num_chunks)
    chunks, start = [], 0
    for i in range(num_chunks):
        size = base + (1 if i < extra else 0)
        chunks.append(items[start : start + size])
        start += size
    return chunks
