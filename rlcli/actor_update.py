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


def old_log_probs_from_update(cfg: RLConfig) -> bool:
    """Whether the separate old-log-prob pass can be skipped: the update is on-policy (one PPO
    epoch, one mini-batch), so the old log-probs ARE the update forward's own (detached; the PPO
    ratio is exactly 1), and nothing before the update needs them (no KL in the reward)."""
    actor = cfg.actor
    mini_batches = cfg.data.train_batch_size // (
        actor.ppo_mini_batch_size or cfg.data.train_batch_size
    )
    return (
        actor.old_log_prob_source == "actor"
        and actor.ppo_epochs == 1
        and mini_batches == 1
        and not cfg.algorithm.use_kl_in_reward
    )


def kl_metric_kind(cfg: RLConfig) -> str:
    """The KL estimator ``actor/kl_to_ref`` reports: the KL loss's, else the reward penalty's."""
    return cfg.actor.kl_loss_type if cfg.actor.use_kl_loss else cfg.algorithm.kl_penalty


def logprob_agreement(
    log_prob: torch.Tensor,
    engine_logprobs: torch.Tensor,
    ref_log_probs: torch.Tensor | None,
    mask: torch.Tensor,
    kl_kind: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sums behind ``rollout/logprob_diff_*`` and ``actor/kl_to_ref`` for ``[B, R]`` tensors:
    ``([|diff| sum, tokens, KL sum, KL tokens] float64, max |diff|)``; add them up over
    micro-batches and DP ranks (``logprob_metrics``)."""
    mask = mask.bool()
    diff = (engine_logprobs.double() - log_prob.detach().double()).abs()[mask]
    sums = [diff.sum(), torch.tensor(float(diff.numel()), dtype=torch.float64)]
    if ref_log_probs is not None:
        kl = algorithms.kl_penalty(log_prob.detach(), ref_log_probs, kl_kind)
        sums += [algorithms.masked_sum(kl, mask).double(), mask.sum().double()]
    else:
        sums += [torch.zeros((), dtype=torch.float64)] * 2
    largest = diff.max() if diff.numel() else torch.zeros((), dtype=torch.float64)
    return torch.stack([x.cpu() for x in sums]), largest.cpu()


def logprob_metrics(
    sums: torch.Tensor, largest: torch.Tensor, stats: DataParallelStats, with_ref: bool
) -> dict[str, float]:
    """Batch-wide metrics from this rank's ``logprob_agreement`` sums (all-reduced over DP)."""
    total, largest = stats.sum(sums), stats.max(largest)
    metrics = {
        "rollout/logprob_diff_mean": (total[0] / total[1]).item() if total[1] > 0 else 0.0,
        "rollout/logprob_diff_max": largest.item(),
    }
    if with_ref:
        metrics["actor/kl_to_ref"] = (total[2] / (total[3] + 1e-8)).item()
    return metrics


# Per-micro-batch metric keys that carry logprob_agreement's sums out of the loss function.
_AGREEMENT_KEYS = ("_diff_sum", "_diff_tokens", "_kl_sum", "_kl_tokens")
_DIFF_MAX = "_diff_max"


def make_actor_loss(
    cfg: RLConfig,
    denominator: torch.Tensor,
    *,
    on_policy: bool = False,
    record_agreement: bool = False,
) -> LossFn:
    """The per-micro-batch loss: policy loss (+ KL loss - entropy bonus), summed-to-exact.

    ``on_policy``: the old log-probs are this forward's own, detached (no ``old_log_probs`` in
    the batch). ``record_agreement``: also report ``logprob_agreement``'s sums of this forward
    against the engine's log-probs (and the reference's) as private metrics.
    """
    actor = cfg.actor
    policy_loss = algorithms.get_policy_loss(actor.policy_loss)
    kl_kind = kl_metric_kind(cfg)

    def loss_fn(outputs: dict[str, torch.Tensor], mb: dict[str, torch.Tensor]):
        index, mask = mb["response_index"], mb["response_mask"].to(outputs["log_probs"].device)
        log_prob = response_values(outputs["log_probs"], index)
        old_log_prob = log_prob.detach() if on_policy else mb["old_log_probs"].to(log_prob.device)
        pg_loss, pg_metrics = policy_loss(
            old_log_prob=old_log_prob,
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
        if record_agreement:
            sums, largest = logprob_agreement(
                log_prob, mb["engine_logprobs"], mb.get("ref_log_probs"), mask, kl_kind
            )
            metrics.update(zip(_AGREEMENT_KEYS, sums.tolist(), strict=True))
            metrics[_DIFF_MAX] = largest.item()
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

    Without ``old_log_probs`` in ``batch`` the update must be on-policy
    (``old_log_probs_from_update``): the old log-probs are the forward's own. When the old
    log-probs did not come from a separate actor pass (skipped, or ``old_log_prob_source=
    engine``), the first mini-batch's forward (before any optimizer step; the whole batch when
    on-policy) also gives ``rollout/logprob_diff_*`` (and ``actor/kl_to_ref``), returned with the
    update's metrics.

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
    on_policy = "old_log_probs" not in batch
    record = on_policy or actor.old_log_prob_source == "engine"
    sums, largest = torch.zeros(4, dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    budget = actor.max_tokens_per_micro_batch
    history: list[dict[str, float]] = []
    skipped = 0
    for _ in range(actor.ppo_epochs):
        for chunk in split_evenly(torch.unique_consecutive(groups).tolist(), num_mini):
            chosen = torch.isin(groups, torch.tensor(chunk))
            mini = {k: v[chosen] for k, v in batch.items()}
            denominator = _global_denominator(mini["response_mask"], cfg, mesh)
            # Only the first mini-batch's forward runs before any optimizer step: the agreement
            # with the engine is measured there (the whole batch when the update is on-policy).
            loss_fn = make_actor_loss(
                cfg, denominator, on_policy=on_policy, record_agreement=record and not history
            )
            result = policy.train_step(
                mini,
                actor.micro_batch_size,
                loss_fn,
                temperature=cfg.rollout.temperature or 1.0,
                compute_entropy=actor.entropy_coeff != 0,
                max_tokens=budget,
            )
            for micro in result["micro_batch_metrics"]:
                if _DIFF_MAX in micro:
                    sums += torch.tensor([micro.pop(k) for k in _AGREEMENT_KEYS], dtype=sums.dtype)
                    largest = torch.maximum(largest, torch.tensor(micro.pop(_DIFF_MAX)).double())
            history.append(reduce_step(result))
            skipped += bool(result.get("skipped", False))
    out = {k: sum(h[k] for h in history) / len(history) for k in history[0]} if history else {}
    out["actor/optimizer_steps"] = float(len(history))
    # A step the optimizer refused (fp16 overflow, non-finite gradients) must not pass unseen.
    out["actor/skipped_steps"] = float(skipped)
    if record:
        with_ref = "ref_log_probs" in batch
        out.update(logprob_metrics(sums, largest, DataParallelStats(mesh), with_ref))
    return out


def reduce_step(
    result: dict[str, Any], prefix: str = "actor", summed: tuple[str, ...] = SUMMED_METRICS
) -> dict[str, float]:
    """One optimizer step's metrics: loss terms (``summed``) summed over micro-batches, the rest
    averaged; grad norm and lr under ``prefix``."""
    per_micro: list[dict[str, float]] = result["micro_batch_metrics"]
    out: dict[str, float] = {}
    for key in per_micro[0] if per_micro else []:
        values = [m[key] for m in per_micro if key in m]
        out[key] = sum(values) if key in summed else sum(values) / len(values)
    out[f"{prefix}/grad_norm"] = float(result.get("grad_norm") or 0.0)
    out[f"{prefix}/lr"] = float(result.get("lr") or 0.0)
    return out
