"""The step's actor update: one PPO-style clipped update over mini/micro-batches, the same for
every algorithm (the estimator and the policy loss are chosen by name in ``algorithms/``).

Where the PPO ratio's old log-probs come from, and so where the trainer-vs-engine log-prob
agreement is measured, is decided once from the config (``RLConfig.old_log_prob_plan``). This module
only arranges tensors and denominators so gradient accumulation over micro-batches and
averaging over data-parallel ranks give exactly the full-batch loss; the mini-batch loop is the
trained-model core's (``rlcli.model.trained_model``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import algorithms
from parallel.cpu_compat import device
from parallel.mesh import Mesh
from parallel.step_types import LossFn, LossReport, ModelOutputs
from rlcli.config.schema import RLConfig, mini_batch_count
from rlcli.model.dp_stats import DataParallelStats
from rlcli.model.trained_model import TrainedModel
from rlcli.rollout.batch import RolloutBatch, response_values
from rlcli.rollout.trajectory import response_limit
from rlcli.train.update_metrics import mean_over_steps, reduce_step


def kl_metric_kind(cfg: RLConfig) -> str:
    """The KL estimator ``actor/kl_to_ref`` reports: the KL loss's, else the reward penalty's."""
    return cfg.actor.kl_loss_type if cfg.actor.use_kl_loss else cfg.algorithm.kl_penalty


def logprob_agreement(
    log_prob: torch.Tensor,
    engine_log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor | None,
    mask: torch.Tensor,
    kl_kind: str,
    agreement_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sums behind ``rollout/logprob_diff_*``, ``rollout/mismatch_*`` and ``actor/kl_to_ref``
    for ``[B, R]`` tensors (``mask``: the generated tokens; ``agreement_mask``: those where the
    engine's log-probs must agree, default ``mask``): ``([|diff| sum, tokens, KL sum, KL
    tokens, *algorithms.MISMATCH_SUMS] float64, max |diff|)``; add them up over micro-batches
    and DP ranks (``logprob_metrics``)."""
    mask = mask.bool()
    agree = mask if agreement_mask is None else agreement_mask.to(mask.device).bool()
    engine_log_probs = engine_log_probs.to(log_prob.device)
    diff = (engine_log_probs.double() - log_prob.detach().double()).abs()[agree]
    sums = [diff.sum(), torch.tensor(float(diff.numel()), dtype=torch.float64)]
    if ref_log_probs is not None:
        kl = algorithms.kl_penalty(log_prob.detach(), ref_log_probs, kl_kind)
        sums += [algorithms.masked_sum(kl, mask).double(), mask.sum().double()]
    else:
        sums += [torch.zeros((), dtype=torch.float64)] * 2
    mismatch = algorithms.mismatch_sums(log_prob, engine_log_probs, agree)
    largest = diff.max() if diff.numel() else torch.zeros((), dtype=torch.float64)
    return torch.cat([torch.stack([x.cpu() for x in sums]), mismatch.cpu()]), largest.cpu()


AGREEMENT_SUMS = 4 + len(algorithms.MISMATCH_SUMS)  # the length of logprob_agreement's sums


def logprob_metrics(
    sums: torch.Tensor, largest: torch.Tensor, stats: DataParallelStats, with_ref: bool
) -> dict[str, float]:
    """Batch-wide metrics from this rank's ``logprob_agreement`` sums (all-reduced over DP)."""
    total, largest = stats.sum(sums), stats.max(largest)
    metrics = {}
    if total[1] > 0:  # (none with rollouts older than the trainer's weights: nothing to compare)
        metrics["rollout/logprob_diff_mean"] = (total[0] / total[1]).item()
        metrics["rollout/logprob_diff_max"] = largest.item()
    if with_ref:
        metrics["actor/kl_to_ref"] = (total[2] / (total[3] + 1e-8)).item()
    mismatch = algorithms.mismatch_metrics(total[4:])
    metrics.update({f"rollout/mismatch_{name}": value for name, value in mismatch.items()})
    return metrics


def agreement_of_actor_pass(batch: RolloutBatch, cfg: RLConfig, stats: DataParallelStats):
    """``rollout/logprob_diff_*`` (and ``actor/kl_to_ref``) of the old_log_prob phase's pass."""
    sums, largest = logprob_agreement(
        batch.require("old_log_probs"),
        batch.engine_log_probs,
        batch.ref_log_probs,
        batch.loss_mask,
        kl_metric_kind(cfg),
        batch.agreement_mask,
    )
    return logprob_metrics(sums, largest, stats, batch.ref_log_probs is not None)


def make_actor_loss(
    cfg: RLConfig,
    denominator: torch.Tensor,
    *,
    on_policy: bool = False,
    record_agreement: bool = False,
) -> LossFn:
    """The per-micro-batch loss: policy loss (+ KL loss - entropy bonus + a top-k
    distillation loss), summed-to-exact.

    ``on_policy``: the old log-probs are this forward's own, detached (the batch carries none).
    ``record_agreement``: also report ``logprob_agreement``'s sums (``LossReport.sums``) and
    largest difference (``LossReport.maxima``) of this forward against the engine's log-probs
    (and the reference's).
    The off-policy correction (``algorithm.off_policy_correction``) turns the old (proximal)
    and the engine's (behaviour) log-probs into the ratio's denominator and per-token weights.
    """
    actor = cfg.actor
    policy_loss = algorithms.get_policy_loss(actor.policy_loss)
    correction = algorithms.get_off_policy_correction(cfg.algorithm.off_policy_correction)
    kl_kind = kl_metric_kind(cfg)
    top_k_loss = (
        algorithms.get_top_k_loss(cfg.distill.objective) if cfg.distill.uses_top_k else None
    )

    def loss_fn(outputs: ModelOutputs, mb: RolloutBatch):
        mask = mb.loss_mask.to(outputs.log_probs.device)
        log_prob = response_values(outputs.log_probs, mb.response_index)
        proximal = log_prob.detach() if on_policy else mb.require("old_log_probs")
        corrected = correction(
            log_prob=log_prob,
            behaviour_log_prob=mb.engine_log_probs.to(log_prob.device),
            proximal_log_prob=proximal.to(log_prob.device),
            response_mask=mask,
            cap=cfg.algorithm.tis_cap,
            mask_low=cfg.algorithm.is_mask_low,
            mask_high=cfg.algorithm.is_mask_high,
        )
        pg_loss, pg_metrics = policy_loss(
            old_log_prob=corrected.old_log_prob,
            log_prob=log_prob,
            advantages=mb.require("advantages").to(log_prob.device),
            response_mask=mask,
            loss_agg_mode=actor.loss_agg_mode,
            clip_ratio_low=actor.clip_ratio_low,
            clip_ratio_high=actor.clip_ratio_high,
            clip_ratio_c=actor.clip_ratio_c,
            global_denominator=denominator,
            rollout_is_weights=corrected.weights,
        )
        loss = pg_loss
        # Loss-valued metrics are partial sums (they add up over micro-batches); ratios are means.
        metrics = {"actor/pg_loss": pg_loss.item()}
        metrics.update({f"actor/{k}": float(v) for k, v in pg_metrics.items()})
        metrics.update({f"actor/{k}": float(v) for k, v in corrected.metrics.items()})
        if outputs.entropy is not None:
            entropy = algorithms.agg_loss(
                response_values(outputs.entropy, mb.response_index),
                mask,
                actor.loss_agg_mode,
                denominator,
            )
            loss = loss - actor.entropy_coeff * entropy
            metrics["actor/entropy"] = entropy.item()
        if actor.use_kl_loss:
            kl = algorithms.compute_kl_loss(
                log_prob,
                mb.require("ref_log_probs").to(log_prob.device),
                mask,
                actor.kl_loss_type,
                actor.loss_agg_mode,
                denominator,
            )
            loss = loss + actor.kl_loss_coef * kl
            metrics["actor/kl_loss"] = kl.item()
        if outputs.scored_log_probs is not None:  # distillation over the teacher's top k
            divergence = top_k_loss(
                response_values(outputs.scored_log_probs, mb.response_index),
                response_values(mb.require("teacher_top_log_probs"), mb.response_index),
                mask,
            )
            distill = algorithms.agg_loss(divergence, mask, actor.loss_agg_mode, denominator)
            loss = loss + cfg.distill.kl_coef * distill
            metrics["actor/distill_loss"] = distill.item()
        report = LossReport(metrics)
        if record_agreement:
            sums, largest = logprob_agreement(
                log_prob, mb.engine_log_probs, mb.ref_log_probs, mask, kl_kind, mb.agreement_mask
            )
            report.sums, report.maxima = sums, largest.double().reshape(1)
        return loss, report

    return loss_fn


SUMMED_METRICS = ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/distill_loss")


def update_actor(
    actor: TrainedModel, batch: RolloutBatch, cfg: RLConfig, fewest_groups: int
) -> dict[str, float]:
    """PPO epochs x mini-batches x micro-batches on this DP rank's share of the batch.

    With the ``update_forward`` plan the old log-probs are the forward's own; unless they came
    from an actor pass, the first mini-batch's forward (before any optimizer step; the whole
    batch when on-policy) also gives ``rollout/logprob_diff_*`` (and ``actor/kl_to_ref``).
    ``fewest_groups`` is the smallest share any DP rank holds: when DAPO keeps fewer groups
    than the configured mini-batch count, fewer (larger) mini-batches are used rather than
    empty ones.
    """
    a = cfg.actor
    plan = cfg.old_log_prob_plan
    record = plan != "actor_pass"

    def loss_for(mini: RolloutBatch, denominator: torch.Tensor, steps_so_far: int) -> LossFn:
        # Only the first mini-batch's forward runs before any optimizer step: the agreement
        # with the engine is measured there (the whole batch when the update is on-policy).
        return make_actor_loss(
            cfg,
            denominator,
            on_policy=plan == "update_forward",
            record_agreement=record and steps_so_far == 0,
        )

    results = actor.update(
        batch,
        loss_for,
        epochs=a.ppo_epochs,
        num_mini_batches=max(
            1,
            min(mini_batch_count(cfg.data.train_batch_size, a.ppo_mini_batch_size), fewest_groups),
        ),
        loss_agg_mode=a.loss_agg_mode,
        norm_length=response_limit(cfg),
        temperature=cfg.rollout.temperature or 1.0,
        compute_entropy=a.entropy_coeff != 0,
    )
    sums = torch.zeros(AGREEMENT_SUMS, dtype=torch.float64)
    largest = torch.zeros((), dtype=torch.float64)
    for result in results:
        for report in result.reports:
            if report.sums is not None:
                sums += report.sums
                largest = torch.maximum(largest, report.maxima[0])
    out = mean_over_steps([reduce_step(r, "actor", SUMMED_METRICS) for r in results])
    out["actor/optimizer_steps"] = float(len(results))
    # A step the optimizer refused (fp16 overflow, non-finite gradients) must not pass unseen.
    out["actor/skipped_steps"] = float(sum(r.skipped for r in results))
    if record:
        with_ref = batch.ref_log_probs is not None
        out.update(logprob_metrics(sums, largest, DataParallelStats(actor.mesh), with_ref))
    if batch.routing is not None:
        changed = [r.routing_changed for r in results if r.routing_changed is not None]
        out["actor/routing_replay_changed"] = routing_share(changed, actor.mesh)
        if cfg.model.moe_routing_replay == "r3" and plan != "actor_pass":
            # the first forward ran the engine's weights: where the trainer's routers disagree
            out["rollout/routing_mismatch"] = routing_share(changed[:1], actor.mesh)
    return out


def old_log_prob_pass(
    actor: TrainedModel, batch: RolloutBatch, cfg: RLConfig, temperature: float
) -> dict[str, float]:
    """The old_log_prob phase: ``batch.old_log_probs`` under the current weights. Routing
    replay R2 records the experts of this pass for the update to replay (``batch.routing``);
    R3 replays the engine's (``batch.routing`` from the rollout) and reports the share of
    (token, MoE layer) pairs the trainer's own routers would have sent elsewhere:
    ``rollout/routing_mismatch`` (docs/algorithms.md)."""
    replay = cfg.model.moe_routing_replay
    if replay is None:
        batch.old_log_probs = actor.forward(batch, temperature)
        return {}
    batch.old_log_probs, notes = actor.forward_and_routing(batch, temperature)
    if replay == "r2":
        batch.routing = notes.recorded
        return {}
    changed = [] if notes.changed is None else [notes.changed]
    return {"rollout/routing_mismatch": routing_share(changed, actor.mesh)}


def routing_share(changed: list[torch.Tensor], mesh: Mesh) -> float:
    """Changed token-layers over token-layers from ``[2]`` partial counts (``routing_changed``),
    over every pipeline stage's MoE layers and every DP rank."""
    total = torch.stack(changed).sum(dim=0) if changed else torch.zeros(2, dtype=torch.float64)
    total = DataParallelStats(mesh).sum(total)
    if mesh.pp > 1:
        on_device = total.to(device())
        dist.all_reduce(on_device, group=mesh.pp_group)
        total = on_device.cpu()
    return float(total[0] / total[1].clamp(min=1))
