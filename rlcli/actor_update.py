"""The step's actor update: one PPO-style clipped update over mini/micro-batches, the same for
every algorithm (the estimator and the policy loss are chosen by name in ``algorithms/``).

This module only arranges tensors and denominators so gradient accumulation over micro-batches
and averaging over data-parallel ranks give exactly the full-batch loss.
"""

from __future__ import annotations

from typing import Any

import torch

import algorithms
from parallel.mesh import Mesh
from parallel.schedule import LossFn
from rlcli.batch import response_values, split_evenly
from rlcli.config import RLConfig
from rlcli.dp_stats import DataParallelStats
from rlcli.policy import MegatronPolicy


def _global_denominator(mask: torch.Tensor, cfg: RLConfig, mesh: Mesh) -> torch.Tensor:
    """This DP rank's share of the mini-batch denominator: megatron's DDP averages gradients over
    DP, so each rank divides by (global denominator / dp) and the average is exact."""
    denom = algorithms.agg_loss_denominator(
        mask, cfg.actor.loss_agg_mode, norm_length=cfg.rollout.max_tokens
    ).double()
    return (DataParallelStats(mesh).sum(denom) / mesh.dp).float()


def make_actor_loss(cfg: RLConfig, denominator: torch.Tensor) -> LossFn:
    """The per-micro-batch loss: policy loss (+ KL loss - entropy bonus), summed-to-exact."""
    actor = cfg.actor
    policy_loss = algorithms.get_policy_loss(actor.policy_loss)

    def loss_fn(outputs: dict[str, torch.Tensor], mb: dict[str, torch.Tensor]):
        index, mask = mb["response_index"], mb["response_mask"].to(outputs["log_probs"].device)
        log_prob = response_values(outputs["log_probs"], index)
        pg_loss, pg_metrics = policy_loss(
            old_log_prob=mb["old_log_probs"].to(log_prob.device),
            log_prob=log_prob,
            advantages=mb["advantages"].to(log_prob.device),
            response_mask=mask,
            loss_agg_mode=actor.loss_agg_mode,
            clip_ratio_low=actor.clip_ratio_low,
            clip_ratio_high=actor.clip_ratio_high,
            clip_ratio_c=actor.clip_ratio_c,
            global_denominator=denominator,
        )
        loss = pg_loss
        # Loss-valued metrics are partial sums (they add up over micro-batches); ratios are means.
        metrics = {"actor/pg_loss": pg_loss.item()}
        metrics.update({f"actor/{k}": float(v) for k, v in pg_metrics.items()})
        if "entropy" in outputs:
            entropy = algorithms.agg_loss(
                response_values(outputs["entropy"], index), mask, actor.loss_agg_mode, denominator
            )
            loss = loss - actor.entropy_coeff * entropy
            metrics["actor/entropy"] = entropy.item()
        if actor.use_kl_loss:
            kl = algorithms.compute_kl_loss(
                log_prob,
                mb["ref_log_probs"].to(log_prob.device),
                mask,
                actor.kl_loss_type,
                actor.loss_agg_mode,
                denominator,
            )
            loss = loss + actor.kl_loss_coef * kl
            metrics["actor/kl_loss"] = kl.item()
        return loss, metrics

    return loss_fn


SUMMED_METRICS = ("actor/pg_loss", "actor/entropy", "actor/kl_loss")


def update_actor(
    policy: MegatronPolicy,
    batch: dict[str, torch.Tensor],
    cfg: RLConfig,
    mesh: Mesh,
    fewest_groups: int,
) -> dict[str, float]:
    """PPO epochs x mini-batches x micro-batches on this DP rank's share of the batch.

    ``batch`` holds this rank's whole groups; it is cut into the same number of mini-batches on
    every DP rank (so optimizer steps line up), each a run of whole groups. ``fewest_groups`` is
    the smallest share any DP rank holds: when DAPO keeps fewer groups than the configured
    mini-batch count, fewer (larger) mini-batches are used rather than empty ones.
    """
    actor = cfg.actor
    configured = cfg.data.train_batch_size // (
        actor.ppo_mini_batch_size or cfg.data.train_batch_size
    )
    num_mini = max(1, min(configured, fewest_groups))
    groups = batch["group_index"]
    history: list[dict[str, float]] = []
    skipped = 0
    for _ in range(actor.ppo_epochs):
        for chunk in split_evenly(torch.unique_consecutive(groups).tolist(), num_mini):
            chosen = torch.isin(groups, torch.tensor(chunk))
            mini = {k: v[chosen] for k, v in batch.items()}
            denominator = _global_denominator(mini["response_mask"], cfg, mesh)
            result = policy.train_step(
                mini,
                actor.micro_batch_size,
                make_actor_loss(cfg, denominator),
                temperature=cfg.rollout.temperature or 1.0,
                compute_entropy=actor.entropy_coeff != 0,
            )
            history.append(_reduce_step(result))
            skipped += bool(result.get("skipped", False))
    out = {k: sum(h[k] for h in history) / len(history) for k in history[0]} if history else {}
    out["actor/optimizer_steps"] = float(len(history))
    # A step the optimizer refused (fp16 overflow, non-finite gradients) must not pass unseen.
    out["actor/skipped_steps"] = float(skipped)
    return out


def _reduce_step(result: dict[str, Any]) -> dict[str, float]:
    """One optimizer step's metrics: loss terms summed over micro-batches, the rest averaged."""
    per_micro: list[dict[str, float]] = result["micro_batch_metrics"]
    out: dict[str, float] = {}
    for key in per_micro[0] if per_micro else []:
        values = [m[key] for m in per_micro if key in m]
        out[key] = sum(values) if key in SUMMED_METRICS else sum(values) / len(values)
    out["actor/grad_norm"] = float(result.get("grad_norm") or 0.0)
    out["actor/lr"] = float(result.get("lr") or 0.0)
    return out
