"""Turning reward-model scores into sample rewards: running normalisation and the combination
with rule rewards.

Shapes: ``scores``, ``rule_rewards`` and ``model_rewards`` are ``[batch]`` (one per sample).
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

CombineMode = Literal["weighted_sum", "gate"]
COMBINE_MODES: tuple[str, ...] = get_args(CombineMode)


class RunningMeanStd:
    """Mean and standard deviation of every score seen so far (exact, not a moving average).

    ``update(scores)`` merges a batch with Chan et al.'s parallel formula (float64, so long runs
    do not drift); ``normalize(scores)`` is ``(scores - mean) / (std + eps)`` with the population
    std. Every rank must update with the same scores (the global batch) to normalise alike.
    ``state_dict`` / ``load_state_dict`` carry the statistics across a resume.
    """

    def __init__(self, eps: float = 1e-6) -> None:
        self.eps = eps
        self.count = 0
        self.mean = 0.0
        self.m2 = 0.0  # sum of squared deviations from the mean

    @property
    def std(self) -> float:
        return (self.m2 / self.count) ** 0.5 if self.count else 1.0

    def update(self, scores: torch.Tensor) -> None:
        values = scores.detach().double().flatten()
        n = values.numel()
        if n == 0:
            return
        batch_mean = float(values.mean())
        batch_m2 = float(((values - batch_mean) ** 2).sum())
        total = self.count + n
        delta = batch_mean - self.mean
        self.mean += delta * n / total
        self.m2 += batch_m2 + delta**2 * self.count * n / total
        self.count = total

    def normalize(self, scores: torch.Tensor) -> torch.Tensor:
        return (scores - self.mean) / (self.std + self.eps)

    def state_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.count, self.mean, self.m2 = int(state["count"]), state["mean"], state["m2"]


def combine_rewards(
    rule_rewards: torch.Tensor,
    model_rewards: torch.Tensor,
    mode: str = "weighted_sum",
    *,
    rule_weight: float = 1.0,
    model_weight: float = 1.0,
    gate_threshold: float = 0.5,
    gate_fail_reward: float = 0.0,
) -> torch.Tensor:
    """Sample rewards ``[batch]`` from rule rewards and reward-model scores.

    ``weighted_sum``: ``rule_weight * rule + model_weight * model``.
    ``gate``: the rule decides whether the model's opinion counts: ``model_weight * model`` where
    ``rule >= gate_threshold``, else ``gate_fail_reward`` (e.g. a wrong answer gets a fixed low
    reward however well written it is).
    """
    if rule_rewards.shape != model_rewards.shape:
        raise ValueError(
            f"rule rewards {tuple(rule_rewards.shape)} and model rewards "
            f"{tuple(model_rewards.shape)} must have the same shape"
        )
    if mode == "weighted_sum":
        return rule_weight * rule_rewards + model_weight * model_rewards
    if mode == "gate":
        failed = torch.full_like(model_rewards, gate_fail_reward)
        return torch.where(rule_rewards >= gate_threshold, model_weight * model_rewards, failed)
    raise ValueError(f"unknown reward combination {mode!r}; choose one of {COMBINE_MODES}")
