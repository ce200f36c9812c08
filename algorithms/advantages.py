"""Advantage estimators behind a string registry (``get_advantage_estimator("grpo")``).

Calling convention (the trainer calls every estimator the same way, with keywords)::

    advantages, returns = estimator(
        token_level_rewards=...,  # [batch, response_len]; outcome rewards sit on the last token
        response_mask=...,        # [batch, response_len]; 1 for response tokens, 0 for padding
        group_index=...,          # [batch]; which prompt each sample came from (tensor/array/list)
        values=...,               # [batch, response_len]; critic values (gae)
        gamma=1.0, lam=1.0,       # discount and GAE lambda
        reward_baselines=...,     # [batch]; reward of the greedy sample (remax)
        epsilon=1e-6,             # added to the group std (grpo)
        norm_adv_by_std=True,     # False turns grpo into Dr.GRPO
        batch_sum=None,           # sums over the whole batch when this is one rank's share
    )

Both outputs are ``[batch, response_len]`` and zero on padding. Every estimator accepts and
ignores keyword arguments it does not use. Group estimators need whole groups; the batch-wide
statistics (whitening, GPG's alpha) go through ``batch_sum`` (``algorithms.utils.BatchSum``), so
each data-parallel rank can compute the advantages of its own groups. The definitions follow verl's ``core_algos.py`` so runs
can be compared number for number. Outcome estimators return the advantages as the returns too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from algorithms.registry import Registry
from algorithms.utils import (
    BatchSum,
    GroupIndex,
    group_ids_to_tensor,
    group_mean_std,
    masked_whiten,
)

AdvantageEstimator = Callable[..., tuple[torch.Tensor, torch.Tensor]]

ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")
# Decorator: make an estimator selectable by name (``algorithm.adv_estimator``).
register_advantage_estimator = ADVANTAGE_ESTIMATORS.register
# The estimator registered under a name; ValueError listing the valid names otherwise.
get_advantage_estimator = ADVANTAGE_ESTIMATORS.lookup
# The estimators whose advantage is one number per sample, computed from the outcome scores of
# its group: one sample per trajectory is what their group statistics assume.
OUTCOME_GROUP_ESTIMATORS = frozenset({"grpo", "rloo", "reinforce_plus_plus_baseline", "opo", "gpg"})


def _outcome_scores(token_level_rewards: torch.Tensor) -> torch.Tensor:
    """One scalar reward per sample ``[batch]``: the sum over the response tokens."""
    return token_level_rewards.sum(dim=-1)


def _broadcast(per_sample: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``[batch]`` -> ``[batch, response_len]``, zero on padding."""
    return per_sample.unsqueeze(-1) * response_mask


def _dense_group_ids(scores: torch.Tensor, group_index: GroupIndex | None) -> torch.Tensor:
    if group_index is None:
        raise ValueError("this advantage estimator needs group_index ([batch] prompt ids)")
    group_ids = group_ids_to_tensor(group_index, device=scores.device)
    if group_ids.shape[0] != scores.shape[0]:
        raise ValueError(f"group_index has {group_ids.shape[0]} ids for {scores.shape[0]} samples")
    return group_ids


def _group_stats(
    scores: torch.Tensor, group_index: GroupIndex | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample ``(group mean, unbiased group std, group size)``, each ``[batch]``."""
    return group_mean_std(scores, _dense_group_ids(scores, group_index))


@register_advantage_estimator("gae")
@torch.no_grad()
def gae_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    values: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    batch_sum: BatchSum | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2016) for PPO with a critic.

    ``values`` ``[batch, response_len]``. Padding positions are skipped: the recursion carries
    the next value and the running advantage across them. Returns ``(advantages, returns)`` with
    ``returns = GAE + values`` and advantages whitened over the mask (zero on padding).
    """
    mask = response_mask.to(values.dtype)
    next_value = torch.zeros_like(values[:, 0])
    running_advantage = torch.zeros_like(values[:, 0])
    advantages_reversed = []
    for t in reversed(range(token_level_rewards.shape[-1])):
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        candidate = delta + gamma * lam * running_advantage
        next_value = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_value
        running_advantage = candidate * mask[:, t] + (1 - mask[:, t]) * running_advantage
        advantages_reversed.append(running_advantage)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    returns = advantages + values
    return masked_whiten(advantages, mask, batch_sum=batch_sum) * mask, returns * mask


@register_advantage_estimator("grpo")
@torch.no_grad()
def grpo_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_index: GroupIndex,
    epsilon: float = 1e-6,
    norm_adv_by_std: bool = True,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO (Shao et al. 2024): ``(r - mean_group) / (std_group + epsilon)`` per sample.

    ``std_group`` is the unbiased std (``torch.std``). A group of one keeps its raw reward
    (baseline 0, scale 1). ``norm_adv_by_std=False`` drops the division: that is Dr.GRPO
    (Liu et al. 2025, "Understanding R1-Zero-like training"), usually paired with
    ``loss_agg_mode="seq-mean-token-sum-norm"``.
    """
    scores = _outcome_scores(token_level_rewards)
    mean, std, size = _group_stats(scores, group_index)
    singleton = size == 1
    mean = torch.where(singleton, torch.zeros_like(mean), mean)
    advantages = scores - mean
    if norm_adv_by_std:
        std = torch.where(singleton, torch.ones_like(std), std)
        advantages = advantages / (std + epsilon)
    advantages = _broadcast(advantages, response_mask)
    return advantages, advantages


@register_advantage_estimator("rloo")
@torch.no_grad()
def rloo_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_index: GroupIndex,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (Ahmadian et al. 2024): reward minus the mean of the OTHER samples of its group,
    ``r_i - (sum_j r_j - r_i) / (n - 1) = n / (n - 1) * (r_i - mean)``. Groups of one keep the raw
    reward."""
    scores = _outcome_scores(token_level_rewards)
    mean, _, size = _group_stats(scores, group_index)
    leave_one_out = (scores - mean) * size / (size - 1).clamp(min=1)
    advantages = torch.where(size > 1, leave_one_out, scores)
    advantages = _broadcast(advantages, response_mask)
    return advantages, advantages


@register_advantage_estimator("reinforce_plus_plus")
@torch.no_grad()
def reinforce_plus_plus_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    batch_sum: BatchSum | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): discounted return-to-go per token, whitened over the whole batch.

    Returns ``(whitened returns, raw returns)``; the return restarts after the end of each response.
    """
    mask = response_mask.to(token_level_rewards.dtype)
    returns = torch.zeros_like(token_level_rewards)
    running_return = torch.zeros_like(token_level_rewards[:, 0])
    for t in reversed(range(token_level_rewards.shape[-1])):
        running_return = token_level_rewards[:, t] + gamma * running_return
        returns[:, t] = running_return
        running_return = running_return * mask[:, t]
    return masked_whiten(returns, mask, batch_sum=batch_sum) * mask, returns


@register_advantage_estimator("reinforce_plus_plus_baseline")
@torch.no_grad()
def reinforce_plus_plus_baseline_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_index: GroupIndex,
    batch_sum: BatchSum | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline: subtract the group mean reward (0 for a group of one), broadcast to
    the tokens, then whiten over all response tokens of the batch."""
    scores = _outcome_scores(token_level_rewards)
    mean, _, size = _group_stats(scores, group_index)
    centred = scores - torch.where(size > 1, mean, torch.zeros_like(mean))
    mask = response_mask.to(scores.dtype)
    advantages = masked_whiten(_broadcast(centred, mask), mask, batch_sum=batch_sum) * mask
    return advantages, advantages


@register_advantage_estimator("remax")
@torch.no_grad()
def remax_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    reward_baselines: torch.Tensor,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023): return-to-go minus the reward of a greedy sample of the same prompt.

    ``reward_baselines`` ``[batch]``. Returns ``(returns - baseline, returns)``.
    """
    mask = response_mask.to(token_level_rewards.dtype)
    returns = (token_level_rewards * mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    advantages = returns - reward_baselines.unsqueeze(-1) * mask
    return advantages, returns


@register_advantage_estimator("opo")
@torch.no_grad()
def opo_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_index: GroupIndex,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (Hao et al. 2025): baseline is the length-weighted group mean
    ``sum_j |y_j| r_j / sum_j |y_j|`` (0 for a group of one)."""
    scores = _outcome_scores(token_level_rewards)
    lengths = response_mask.to(scores.dtype).sum(dim=-1)
    group_ids = _dense_group_ids(scores, group_index)
    num_groups = int(group_ids.max()) + 1
    weighted = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device)
    weighted.index_add_(0, group_ids, lengths * scores)
    total_length = torch.zeros_like(weighted).index_add_(0, group_ids, lengths)
    size = torch.zeros_like(weighted).index_add_(0, group_ids, torch.ones_like(scores))
    baseline = torch.where(size > 1, weighted / total_length, torch.zeros_like(weighted))
    advantages = _broadcast(scores - baseline[group_ids], response_mask)
    return advantages, advantages


@register_advantage_estimator("gpg")
@torch.no_grad()
def gpg_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_index: GroupIndex,
    f_norm: float = 1.0,
    batch_sum: BatchSum | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (Chu et al. 2025): ``alpha * (r - mean_group) / f_norm`` with
    ``alpha = batch / (number of samples with non-zero reward)`` correcting for samples that carry
    no gradient. The group mean of a group of one is 0."""
    scores = _outcome_scores(token_level_rewards)
    mean, _, size = _group_stats(scores, group_index)
    total = batch_sum or (lambda tensor: tensor)
    size_of_batch = total(torch.tensor(float(scores.shape[0]), device=scores.device))
    alpha = size_of_batch / total(torch.count_nonzero(scores).float()).clamp(min=1)
    centred = scores - torch.where(size > 1, mean, torch.zeros_like(mean))
    advantages = _broadcast(alpha * centred / f_norm, response_mask)
    return advantages, advantages
