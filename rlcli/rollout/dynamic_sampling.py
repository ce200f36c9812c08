"""DAPO's dynamic sampling (``algorithm.dynamic_sampling``): a group whose samples all get the
same reward gives every sample zero advantage, so the step trains only on the groups whose
reward varies.

Two parts, in the step's order:

1. the rollout draws more prompts (up to ``max_gen_batches`` rounds, ``rlcli.rollout.sampling``) until
   its rounds hold ``data.train_batch_size`` informative groups by the rule reward, which is the
   reward trained on unless a reward model or judge adds to it (then there is one round:
   ``rlcli.validation.rewards``);
2. after every reward (rule, reward model, judge), ``keep_informative_groups`` is the filter:
   the step keeps the first ``data.train_batch_size`` informative groups and reports
   ``dapo/kept_groups_ratio``, the informative groups among all the groups drawn.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

import algorithms
from rlcli.rollout.batch import Sample, groups_of

if TYPE_CHECKING:
    from rlcli.config.algorithm import DynamicSamplingConfig


def filter_metric(sample: Sample, name: str) -> float:
    """DAPO's filter value of a sample: the reward field ``name`` (e.g. ``acc``), else its score."""
    return float(sample.extras.get(name, sample.score))


def informative_groups(samples: list[Sample], metric: str) -> list[list[Sample]]:
    """The groups whose ``metric`` varies (the others carry no signal), in order."""
    if not samples:
        return []
    values = torch.tensor([filter_metric(s, metric) for s in samples])
    keep, _ = algorithms.filter_groups(values, torch.tensor([s.group for s in samples]))
    keep_ids = {s.group for s, k in zip(samples, keep.tolist(), strict=True) if k}
    return [g for g in groups_of(samples) if g[0].group in keep_ids]


def keep_informative_groups(
    samples: list[Sample], dynamic_sampling: DynamicSamplingConfig, batch_size: int
) -> tuple[list[Sample], dict[str, float]]:
    """The step's filter (module docstring): the samples of the first ``batch_size`` groups
    whose ``dynamic_sampling.metric`` varies, and ``dapo/kept_groups_ratio``. Every rank holds
    every sample, so every rank keeps the same."""
    groups = informative_groups(samples, dynamic_sampling.metric)
    drawn = len(groups_of(samples))
    kept = groups[:batch_size]
    metrics = {
        "dapo/kept_groups_ratio": len(groups) / max(drawn, 1),
        "dapo/kept_groups": float(len(kept)),
        "dapo/drawn_groups": float(drawn),
    }
    return [s for g in kept for s in g], metrics
