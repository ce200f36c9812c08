"""Checks of where the engines run (``rollout.placement``, ``rollout.num_ranks``) and of the
staleness they may run ahead with (``trainer.max_staleness``, ``algorithm.off_policy_correction``),
called by ``rlcli.validation.validate.validate``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlcli.errors import UserError

if TYPE_CHECKING:
    from rlcli.config.schema import RLConfig


def trainer_ranks(cfg: RLConfig, world_size: int) -> int:
    """How many of ``world_size`` ranks train: all of them colocated, all but the
    ``rollout.num_ranks`` engine ranks in the separate placement."""
    return world_size - cfg.rollout.num_ranks if cfg.rollout.is_separate else world_size


def check_placement(cfg: RLConfig) -> None:
    """``rollout.placement`` / ``rollout.num_ranks`` on their own (the world is checked later)."""
    r = cfg.rollout
    if r.num_ranks < 0:
        raise UserError(f"rollout.num_ranks must be >= 0, got {r.num_ranks}")
    if not r.is_separate:
        if r.num_ranks:
            raise UserError(
                f"rollout.num_ranks={r.num_ranks} applies only to rollout.placement=separate "
                "(colocated engines share every rank with the trainer): set "
                "rollout.placement=separate, or rollout.num_ranks=0"
            )
        return
    if r.num_ranks == 0:
        raise UserError(
            "rollout.placement=separate needs rollout ranks: set rollout.num_ranks (how many of "
            f"the processes only run engines; a multiple of rollout.tp={r.tp})"
        )
    if r.num_ranks % r.tp:
        raise UserError(
            f"rollout.num_ranks={r.num_ranks} is not divisible by rollout.tp={r.tp}: each engine "
            f"takes rollout.tp ranks"
        )
    offloaded = [k for k in ("params", "grads", "optimizer") if getattr(cfg.actor, f"offload_{k}")]
    if offloaded:
        keys = ", ".join(f"actor.offload_{k}=true" for k in offloaded)
        raise UserError(
            f"{keys} has no effect with rollout.placement=separate: the engines run on their own "
            "ranks, so nothing leaves the trainer's device for them; set it to false"
        )
    if cfg.actor.lora.enable:
        # The rollout ranks' engines take full weights only (no vLLM LoRA slots there), and a
        # LoRA run's checkpoints, resume and merged sync are tested with colocated engines only.
        raise UserError(
            f"actor.lora.enable=true with rollout.placement=separate is not supported (with "
            f"either rollout.lora_sync, here {cfg.rollout.lora_sync}): set "
            "rollout.placement=colocated (and rollout.num_ranks=0), or actor.lora.enable=false"
        )

    if cfg.reward.uses_model_reward:
        # Model rewards score on the trainer's ranks after the rollout; with engines on their
        # own ranks the samples (and DAPO's filter) are made there, ahead, without them.
        raise UserError(
            "reward.model.path / reward.judge.path with rollout.placement=separate is not "
            "supported: set rollout.placement=colocated (and rollout.num_ranks=0), or score "
            "with a rule reward (reward.fn)"
        )


def check_off_policy(cfg: RLConfig) -> None:
    """Staleness and the off-policy correction: only settings whose samples can be corrected
    for the policy that generated them."""
    k = cfg.trainer.max_staleness
    correction = cfg.algorithm.off_policy_correction
    engine_old = cfg.actor.old_log_prob_source == "engine"
    if k < 0:
        raise UserError(f"trainer.max_staleness must be >= 0, got {k}")
    if not cfg.algorithm.tis_cap >= 1:
        raise UserError(
            f"algorithm.tis_cap must be >= 1 (a cap below 1 would shrink the weight of on-policy "
            f"tokens too), got {cfg.algorithm.tis_cap}"
        )
    low, high = cfg.algorithm.is_mask_low, cfg.algorithm.is_mask_high
    if not 0 <= low <= 1 <= high or low == high:
        raise UserError(
            f"algorithm.is_mask_low={low} and algorithm.is_mask_high={high} must satisfy "
            "0 <= is_mask_low <= 1 <= is_mask_high (not both 1): a range without 1 would mask "
            "tokens on which the trainer and the engine agree"
        )
    if correction not in ("none", "tis") and engine_old:
        raise UserError(
            f"algorithm.off_policy_correction={correction} needs the trainer's log-probs before "
            "the update (the proximal policy), but actor.old_log_prob_source=engine puts the "
            "engine's in their place: set actor.old_log_prob_source=actor"
        )
    if k == 0:
        return
    if not cfg.rollout.is_separate:
        raise UserError(
            f"trainer.max_staleness={k} needs rollout.placement=separate: colocated engines "
            "generate between the trainer's phases on the same ranks, so there is nothing to "
            "overlap; set trainer.max_staleness=0 or rollout.placement=separate"
        )
    if correction == "none" and not engine_old:
        raise UserError(
            f"trainer.max_staleness={k} trains on samples up to {k} weight versions old, but "
            "algorithm.off_policy_correction=none takes the PPO ratio against the trainer's "
            "recomputed log-probs, which are not the policy that sampled them (the correction "
            "would silently vanish): set algorithm.off_policy_correction=decoupled_ppo (or tis), "
            "or actor.old_log_prob_source=engine"
        )
    if cfg.rollout.temperature == 0:
        raise UserError(
            f"trainer.max_staleness={k} with rollout.temperature=0: greedy samples have no "
            "behaviour distribution to correct with; sample with rollout.temperature > 0"
        )
