"""The step's advantage phase: scores -> token rewards (KL-in-reward, DAPO overlong) ->
advantages (mixed with on-policy distillation's per-token signal, ``distill.*``), on this
data-parallel rank's whole groups.

Each DP rank holds whole groups, so group estimators need nothing from other ranks; the
batch-wide statistics some estimators and the KL controller need come from ``stats.sum``
(an all-reduce), which makes the result equal to computing on the whole batch at once.
"""

from __future__ import annotations

import torch

import algorithms
from rlcli.config.schema import RLConfig
from rlcli.model.dp_stats import DataParallelStats
from rlcli.rollout.batch import RolloutBatch
from rlcli.rollout.trajectory import response_limit

KLController = algorithms.FixedKLController | algorithms.AdaptiveKLController


def token_level_scores(batch: RolloutBatch, cfg: RLConfig) -> torch.Tensor:
    """``[B, R]``: the outcome score on each response's last generated token, DAPO's overlong
    shaping added: the tokens the policy generated (``loss_mask``: a multi-turn trajectory's
    tool / environment tokens are not its length) against the run's response budget
    (``response_limit``: ``rollout.max_tokens``, or a trajectory's
    ``rollout.multi_turn.max_response_tokens``; ``rollout.max_tokens`` is then per turn)."""
    generated = batch.loss_mask
    lengths = generated.sum(-1).long()
    scores = batch.scores.clone()
    if cfg.algorithm.overlong.enabled:
        scores += algorithms.overlong_penalty(
            lengths,
            response_limit(cfg),
            cfg.algorithm.overlong.buffer_len,
            cfg.algorithm.overlong.penalty_factor,
        )
    token_scores = torch.zeros_like(generated)
    # The last position whose loss mask is 1 (a multi-turn response may end with tool tokens).
    positions = torch.arange(generated.shape[1], dtype=torch.float32)
    last = (generated * (positions + 1)).argmax(-1)
    has_generated = generated.sum(-1) > 0
    token_scores[torch.arange(len(lengths)), last] = scores * has_generated
    return token_scores


def compute_advantages(
    batch: RolloutBatch,
    cfg: RLConfig,
    kl_ctrl: KLController,
    stats: DataParallelStats,
) -> dict[str, float]:
    """Fills ``token_level_rewards``, ``advantages`` and ``returns`` (``[B, R]``) of ``batch``,
    this rank's whole groups; returns batch-wide metrics."""
    algo = cfg.algorithm
    rewards = token_level_scores(batch, cfg)
    metrics: dict[str, float] = {}
    if algo.use_kl_in_reward:
        rewards, kl_metrics = algorithms.apply_kl_penalty_to_rewards(
            rewards,
            batch.require("old_log_probs"),
            batch.require("ref_log_probs"),
            batch.loss_mask,
            kl_ctrl,
            algo.kl_penalty,
            batch_sum=stats.sum,
        )
        metrics.update({k: float(v) for k, v in kl_metrics.items()})
    advantages, returns = _estimate(batch, cfg, rewards, stats)
    if cfg.distill.enable:
        advantages, distill_metrics = distilled_advantages(batch, cfg, advantages, stats)
        returns = advantages
        metrics.update(distill_metrics)
    batch.token_level_rewards, batch.advantages, batch.returns = rewards, advantages, returns
    mask = batch.loss_mask
    total = stats.sum(torch.stack([algorithms.masked_sum(advantages, mask), mask.sum()]))
    metrics["critic/advantages_mean"] = (total[0] / (total[1] + 1e-8)).item()
    metrics["critic/advantages_abs_max"] = stats.max((advantages.abs() * mask).max()).item()
    return metrics


def _estimate(
    batch: RolloutBatch, cfg: RLConfig, rewards: torch.Tensor, stats: DataParallelStats
) -> tuple[torch.Tensor, torch.Tensor]:
    """``algorithm.adv_estimator`` on the batch. An outcome-group estimator (GRPO, RLOO, ...)
    sees one row per trajectory: an agent trajectory split into segments would otherwise count
    once per segment in its group's mean and spread. Its last segment stands for it (every
    segment carries the trajectory's score) and its advantage goes to all its segments."""
    algo = cfg.algorithm
    trajectories, owner = torch.unique(batch.trajectory_index, return_inverse=True)
    rows = None
    split = len(trajectories) < len(owner)
    if split and algo.adv_estimator in algorithms.OUTCOME_GROUP_ESTIMATORS:
        every_row = torch.arange(len(owner))
        last = torch.full((len(trajectories),), -1, dtype=torch.long)
        rows = last.scatter_reduce(0, owner, every_row, reduce="amax")
    pick = (lambda t: t) if rows is None else (lambda t: None if t is None else t[rows])
    estimator = algorithms.get_advantage_estimator(algo.adv_estimator)
    advantages, returns = estimator(
        token_level_rewards=pick(rewards),
        response_mask=pick(batch.loss_mask),
        group_index=pick(batch.group_index),
        values=pick(batch.values),
        gamma=algo.gamma,
        lam=algo.lam,
        reward_baselines=pick(batch.reward_baselines),
        epsilon=algo.epsilon,
        norm_adv_by_std=algo.norm_adv_by_std,
        batch_sum=stats.sum,
    )
    if rows is None:
        return advantages, returns
    mask = batch.loss_mask[rows]
    # one number per trajectory (the estimator gives it to each of its row's tokens)
    per_trajectory = algorithms.masked_sum(advantages, mask, dim=-1) / mask.sum(-1).clamp(min=1)
    full = per_trajectory[owner].unsqueeze(-1) * batch.loss_mask
    return full, full


def distilled_advantages(
    batch: RolloutBatch, cfg: RLConfig, task_advantages: torch.Tensor, stats: DataParallelStats
) -> tuple[torch.Tensor, dict[str, float]]:
    """On-policy distillation's advantages (``distill.*``): minus ``distill.kl_coef`` times the
    per-token divergence from the teacher on the generated tokens, plus ``distill.reward_weight``
    times the task's own; and the divergence's batch-wide metrics."""
    d, mask = cfg.distill, batch.loss_mask
    student, teacher = batch.require("old_log_probs"), batch.require("teacher_log_probs")
    # A top-k objective is a loss of the update (rlcli.train.actor_update): the advantage keeps
    # only the task's share, and the sampled tokens' reverse KL is reported beside it.
    objective = "reverse_kl" if d.uses_top_k else d.objective
    divergence = algorithms.get_distill_objective(objective)(student, teacher, mask)
    k3 = algorithms.k3_divergence(student, teacher, mask)
    advantages = algorithms.distillation_advantages(
        divergence, task_advantages, mask, 0.0 if d.uses_top_k else d.kl_coef, d.reward_weight
    )
    quarters = algorithms.response_quarters(mask)
    in_quarter = [(quarters == q).to(divergence.dtype) for q in range(4)]
    sums = stats.sum(
        torch.stack(
            [divergence.sum(), k3.sum(), mask.sum(), algorithms.masked_sum(teacher, mask)]
            + [(divergence * part).sum() for part in in_quarter]
            + [part.sum() for part in in_quarter]
        ).double()
    )
    tokens = sums[2].clamp(min=1)
    metrics = {
        "distill/reverse_kl": (sums[0] / tokens).item(),
        "distill/reverse_kl_k3": (sums[1] / tokens).item(),
        "distill/reverse_kl_max": stats.max((divergence * mask).max()).item(),
        "distill/teacher_log_prob": (sums[3] / tokens).item(),
    }
    for q in range(4):  # by position: the responses' first quarter of tokens ... last quarter
        metrics[f"distill/reverse_kl_q{q + 1}"] = (sums[4 + q] / sums[8 + q].clamp(min=1)).item()
    return advantages, metrics
