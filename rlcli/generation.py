"""Rollout and scoring: prompts -> engine samples on every replica -> all ranks -> rewards.

Every rank draws the same global batch of prompts; rollout replica ``r`` of ``R`` (a replica is
``rollout.tp`` ranks sharing one engine) samples its contiguous slice. The samples are then
exchanged so every rank holds all of them (they are small: token ids and floats), and each
training data-parallel rank picks its own whole groups (``rlcli.batch.balance_groups``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlcli.batch import Sample, split_evenly
from rlcli.rewards import RewardInput, RewardManager
from rlcli.rollout.base import RolloutEngine, SamplingConfig


@dataclass(frozen=True)
class ReplicaInfo:
    index: int  # this rank's replica
    count: int  # replicas in the world
    is_leader: bool  # the replica's first rank reports its samples (the others hold the same)


def generate_samples(
    engine: RolloutEngine,
    items: list,
    n: int,
    sampling: SamplingConfig,
    replica: ReplicaInfo,
    group_offset: int = 0,
) -> list[Sample]:
    """Sample ``n`` responses for each prompt of ``items``; returns ALL replicas' samples, on every
    rank, ordered by prompt. ``group`` numbers prompts from ``group_offset``."""
    mine = split_evenly(list(enumerate(items)), replica.count)[replica.index]
    local: list[Sample] = []
    if mine:
        outputs = engine.generate([item.prompt_token_ids for _, item in mine], n, sampling)
        for (position, item), completions in zip(mine, outputs, strict=True):
            for completion in completions:
                local.append(
                    Sample(
                        group=group_offset + position,
                        prompt_ids=list(item.prompt_token_ids),
                        response_ids=list(completion.token_ids),
                        engine_logprobs=list(completion.logprobs),
                        finish_reason=completion.finish_reason,
                        item=item,
                    )
                )
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return local
    gathered: list[list[Sample] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local if replica.is_leader else [])
    return sorted((s for part in gathered for s in part or []), key=lambda s: s.group)


def score_samples(samples: list[Sample], rewards: RewardManager, tokenizer) -> dict[str, float]:
    """Fill ``score`` / ``extras`` of every sample; returns failure counts as metrics.

    Every rank scores the same samples (rule-based rewards are cheap and this keeps ranks in
    step without another exchange); a model-based reward would score its share and exchange.
    """
    texts = tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)
    inputs = [
        RewardInput(
            data_source=s.item.data_source,
            solution_str=text,
            ground_truth=s.item.ground_truth,
            extra_info=s.item.extra_info,
        )
        for s, text in zip(samples, texts, strict=True)
    ]
    scores, extras, stats = rewards.score_batch(inputs)
    for i, sample in enumerate(samples):
        sample.score = float(scores[i])
        sample.extras = {key: values[i] for key, values in extras.items() if values[i] is not None}
    return {key: float(value) for key, value in stats.items()}


def accuracy_of(samples: list[Sample]) -> float:
    """Mean of the reward's ``acc`` field where it gives one, else of ``score > 0``."""
    if not samples:
        return float("nan")
    hits = [float(s.extras.get("acc", s.score > 0)) for s in samples]
    return sum(hits) / len(hits)


def rollout_metrics(samples: list[Sample], max_tokens: int, prefix: str = "") -> dict[str, float]:
    scores = torch.tensor([s.score for s in samples], dtype=torch.float64)
    lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float64)
    clipped = [s.finish_reason == "length" or len(s.response_ids) >= max_tokens for s in samples]
    return {
        f"{prefix}reward/score_mean": scores.mean().item(),
        f"{prefix}reward/score_std": scores.std().item() if len(samples) > 1 else 0.0,
        f"{prefix}reward/accuracy": accuracy_of(samples),
        f"{prefix}response_length/mean": lengths.mean().item(),
        f"{prefix}response_length/max": lengths.max().item(),
        f"{prefix}response_length/clip_ratio": sum(clipped) / len(samples),
    }
