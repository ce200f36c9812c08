"""Checks on a loaded config that need more than types: relations between keys, names looked up in
registries, the parallel layout for a given world size, and the settings that depend on the
model's config.json (`rlcli.validation.model`). Every failure is a UserError naming the key.
(Choices of a fixed set are declared on the fields themselves as ``Literal`` types in
``rlcli.config.schema`` and checked while the config loads.)"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlcli.errors import UserError
from rlcli.validation.agents import check_agent
from rlcli.validation.distill import check_distill
from rlcli.validation.model import (
    check_hf_engine,
    check_lora,
    check_moe_settings,
    check_packing,
)
from rlcli.validation.placement import check_off_policy, check_placement
from rlcli.validation.ranges import check_ranges
from rlcli.validation.rewards import check_model_rewards

if TYPE_CHECKING:
    from rlcli.config.schema import ParallelConfig, RLConfig, TrainedModelConfig


def derive_dp(cfg: ParallelConfig, world_size: int) -> int:
    """Data-parallel size for ``world_size`` ranks; raises UserError for impossible layouts."""
    for key in ("tp", "pp"):
        if getattr(cfg, key) < 1:
            raise UserError(f"parallel.{key} must be >= 1, got {getattr(cfg, key)}")
    model_parallel = cfg.tp * cfg.pp
    if world_size % model_parallel:
        raise UserError(
            f"world size {world_size} is not divisible by tp*pp = {model_parallel} "
            f"(parallel.tp={cfg.tp}, parallel.pp={cfg.pp})"
        )
    dp = world_size // model_parallel
    if cfg.dp is not None and cfg.dp != dp:
        raise UserError(
            f"parallel.dp={cfg.dp} does not match world size {world_size} / (tp*pp = {model_parallel}) = {dp}; "
            "leave parallel.dp unset to derive it"
        )
    expert_tp = cfg.expert_tp or cfg.tp
    if (cfg.tp * dp) % (cfg.ep * expert_tp):
        raise UserError(
            f"parallel.ep={cfg.ep} x expert TP {expert_tp} must divide the tp x dp = "
            f"{cfg.tp} x {dp} ranks of a pipeline stage: with parallel.expert_tp unset (= tp), "
            f"parallel.ep must divide the data-parallel size {dp}"
        )
    return dp


def validate(cfg: RLConfig, world_size: int | None = None) -> None:
    """Check relations between keys; ``world_size`` also checks the parallel layout."""
    check_ranges(cfg)
    _check_reliability(cfg)
    check_moe_settings(cfg)
    if cfg.trainer.resume not in ("auto", "none") and not cfg.trainer.resume:
        raise UserError("trainer.resume is empty: use 'auto', 'none' or a checkpoint directory")
    for key, section in cfg.trained_models:
        _check_trained_model(key, section, cfg)
    if cfg.algorithm.uses_critic and cfg.critic.cliprange_value <= 0:
        raise UserError(f"critic.cliprange_value must be > 0, got {cfg.critic.cliprange_value}")
    if cfg.trainer.critic_warmup < 0:
        raise UserError(f"trainer.critic_warmup must be >= 0, got {cfg.trainer.critic_warmup}")
    if cfg.trainer.critic_warmup and not cfg.algorithm.uses_critic:
        raise UserError(
            f"trainer.critic_warmup={cfg.trainer.critic_warmup} needs a critic "
            "(algorithm.adv_estimator=gae); set trainer.critic_warmup=0"
        )
    _check_multi_turn(cfg)
    check_agent(cfg)
    _check_logging(cfg)
    check_model_rewards(cfg, world_size)
    check_lora(cfg)
    positive = {
        "data.train_batch_size": cfg.data.train_batch_size,
        "data.max_prompt_length": cfg.data.max_prompt_length,
        "rollout.n": cfg.rollout.n,
        "rollout.tp": cfg.rollout.tp,
        "rollout.max_tokens": cfg.rollout.max_tokens,
        "rollout.val_n": cfg.rollout.val_n,
        "sft.batch_size": cfg.sft.batch_size,
        "sft.micro_batch_size": cfg.sft.micro_batch_size,
        "checkpoint.keep_last": cfg.checkpoint.keep_last,
    }
    for key, value in positive.items():
        if value < 1:
            raise UserError(f"{key} must be >= 1, got {value}")
    check_hf_engine("rollout", cfg.rollout)
    if not 0.0 <= cfg.data.synthetic_tool_share <= 1.0:
        raise UserError(
            f"data.synthetic_tool_share must be in [0, 1], got {cfg.data.synthetic_tool_share}"
        )
    check_placement(cfg)
    check_off_policy(cfg)
    check_distill(cfg, world_size)
    if cfg.rollout.sync_bucket_mb < 0:
        raise UserError(
            f"rollout.sync_bucket_mb must be >= 0 (0: automatic), got {cfg.rollout.sync_bucket_mb}"
        )
    _check_schedules(cfg)
    _check_sampling(cfg)
    _check_overlong(cfg)
    if not cfg.model.path and not cfg.model.build:
        raise UserError("model.path is empty: give a HuggingFace model directory (model.path=DIR)")
    if world_size is not None:
        _check_world(cfg, world_size)
    # Last: the registries import torch (about 2 s), which a mistake found above never waits for.
    _check_algorithm_names(cfg)


def _check_world(cfg: RLConfig, world_size: int) -> None:
    """The layout of ``world_size`` ranks: the trainer's TP x PP x DP, the engines' TP."""
    r, par = cfg.rollout, cfg.parallel
    if not r.is_separate:
        derive_dp(par, world_size)
        if world_size % r.tp:
            raise UserError(f"world size {world_size} is not divisible by rollout.tp={r.tp}")
        return
    trainers = world_size - r.num_ranks
    if trainers < 1:
        raise UserError(
            f"rollout.num_ranks={r.num_ranks} makes every one of the {world_size} processes a "
            f"rollout rank: leave at least parallel.tp x parallel.pp = {par.tp * par.pp} to train "
            "(launch more processes or lower rollout.num_ranks)"
        )
    if trainers % (par.tp * par.pp):
        raise UserError(
            f"{trainers} trainer ranks ({world_size} processes - rollout.num_ranks="
            f"{r.num_ranks}) are not divisible by parallel.tp x parallel.pp = {par.tp * par.pp}"
        )
    derive_dp(par, trainers)


def _check_trained_model(key: str, section: TrainedModelConfig, cfg: RLConfig) -> None:
    """The keys every trained model (``actor``, ``critic``) shares (its ``loss_agg_mode``: in
    `_check_algorithm_names`)."""
    for name in ("micro_batch_size", "ppo_epochs", "recompute_num_layers"):
        if getattr(section, name) < 1:
            raise UserError(f"{key}.{name} must be >= 1, got {getattr(section, name)}")
    for name in ("max_tokens_per_micro_batch", "max_tokens_per_forward", "lr_warmup_steps"):
        if getattr(section, name) < 0:
            raise UserError(f"{key}.{name} must be >= 0, got {getattr(section, name)}")
    # A budget must hold the longest sequence a step can produce, or that sequence would be cut
    # into a micro-batch above the budget (or, packed, not fit at all).
    longest = cfg.data.max_prompt_length + cfg.rollout.max_tokens
    for name in ("max_tokens_per_micro_batch", "max_tokens_per_forward"):
        budget = getattr(section, name)
        if 0 < budget < longest:
            raise UserError(
                f"{key}.{name}={budget} is smaller than the longest sequence it must hold: "
                f"data.max_prompt_length + rollout.max_tokens = {longest}; set it to at least "
                f"{longest} (or 0: micro_batch_size rows)"
            )
    check_packing(key, section.pack_sequences, cfg)
    mini = section.ppo_mini_batch_size
    if mini is not None and (mini < 1 or cfg.data.train_batch_size % mini):
        raise UserError(
            f"{key}.ppo_mini_batch_size={mini} must divide data.train_batch_size="
            f"{cfg.data.train_batch_size}"
        )
    total = cfg.trainer.total_steps
    if total is not None and section.lr_warmup_steps >= total:
        raise UserError(
            f"{key}.lr_warmup_steps={section.lr_warmup_steps} must be smaller than "
            f"trainer.total_steps={total} (the warmup is part of the run)"
        )


def _check_sampling(cfg: RLConfig) -> None:
    r = cfg.rollout
    if r.temperature < 0:
        raise UserError(f"rollout.temperature must be >= 0, got {r.temperature}")
    if not 0 < r.top_p <= 1:
        raise UserError(f"rollout.top_p must be in (0, 1], got {r.top_p}")
    if any(t < 0 for t in r.stop_token_ids):
        raise UserError(f"rollout.stop_token_ids must be token ids >= 0, got {r.stop_token_ids}")
    if r.max_model_len is not None:
        need = cfg.data.max_prompt_length + r.max_tokens
        if r.max_model_len < need:
            raise UserError(
                f"rollout.max_model_len={r.max_model_len} is shorter than "
                f"data.max_prompt_length + rollout.max_tokens = {need}"
            )
    if cfg.actor.clip_ratio_c <= 1:
        raise UserError(f"actor.clip_ratio_c must be > 1 (dual-clip), got {cfg.actor.clip_ratio_c}")


def _check_overlong(cfg: RLConfig) -> None:
    """DAPO's overlong buffer lies inside the response budget (``rlcli.rollout.trajectory.
    response_limit``), which it is measured against (``rlcli.train.advantages``)."""
    overlong, multi_turn = cfg.algorithm.overlong, cfg.rollout.multi_turn
    if not overlong.enabled:
        return
    key, budget = "rollout.max_tokens", cfg.rollout.max_tokens
    if multi_turn.enable:
        key, budget = "rollout.multi_turn.max_response_tokens", multi_turn.max_response_tokens
    if cfg.rollout.agent is not None:
        key = "rollout.agent_options.max_response_tokens"
        budget = cfg.rollout.agent_options.max_response_tokens
    if not 0 < overlong.buffer_len <= budget:
        raise UserError(
            f"algorithm.overlong.buffer_len={overlong.buffer_len} must be in (0, {key}={budget}]: "
            "the penalty grows over the last buffer_len tokens of the response budget"
        )


def _check_multi_turn(cfg: RLConfig) -> None:
    """``rollout.multi_turn``, checked only when enabled: limits, and the tool config and the
    environment resolved (an unknown tool, a class that is not a tool, an invalid JSON schema)
    before anything starts. Tools are built (and the python sandbox probed) by the rollout."""
    mt = cfg.rollout.multi_turn
    if not mt.enable:
        return
    for key in (
        "max_assistant_turns",
        "max_tool_calls_per_turn",
        "max_tool_response_tokens",
        "max_response_tokens",
    ):
        if getattr(mt, key) < 1:
            raise UserError(f"rollout.multi_turn.{key} must be >= 1, got {getattr(mt, key)}")
    if not mt.tool_timeout_s > 0:
        raise UserError(f"rollout.multi_turn.tool_timeout_s must be > 0, got {mt.tool_timeout_s}")
    if cfg.data.apply_chat_template is False:
        raise UserError(
            "rollout.multi_turn.enable=true renders every turn with the chat template: set "
            "data.apply_chat_template to null (auto) or true"
        )
    if cfg.rollout.max_model_len is not None:
        need = cfg.data.max_prompt_length + mt.max_response_tokens
        if cfg.rollout.max_model_len < need:
            raise UserError(
                f"rollout.max_model_len={cfg.rollout.max_model_len} is shorter than "
                f"data.max_prompt_length + rollout.multi_turn.max_response_tokens = {need}"
            )
    if mt.tool_config is None and mt.environment is None:
        raise UserError(
            "rollout.multi_turn.enable=true needs tools (rollout.multi_turn.tool_config=FILE) or "
            "an environment (rollout.multi_turn.environment=NAME)"
        )
    if mt.tool_config is not None:
        from rlcli.tools.tool_config import load_tool_config

        load_tool_config(mt.tool_config)
    if mt.environment is not None:
        from rlcli.environments.base import resolve_environment_class

        resolve_environment_class(mt.environment)


def _check_schedules(cfg: RLConfig) -> None:
    """Step counts and controller settings that would otherwise fail deep inside megatron-core's
    LR scheduler or the KL controller, after minutes of work."""
    for key, value in (
        ("sft.lr_warmup_steps", cfg.sft.lr_warmup_steps),
        ("sft.steps", cfg.sft.steps),
        ("sft.save_freq", cfg.sft.save_freq),
    ):
        if value < 0:
            raise UserError(f"{key} must be >= 0, got {value}")
    if cfg.sft.steps and cfg.sft.lr_warmup_steps >= cfg.sft.steps:
        raise UserError(
            f"sft.lr_warmup_steps={cfg.sft.lr_warmup_steps} must be smaller than "
            f"sft.steps={cfg.sft.steps}"
        )
    kl = cfg.algorithm.kl_ctrl
    if kl.type == "adaptive":
        if kl.horizon < 1:
            raise UserError(
                f"algorithm.kl_ctrl.horizon={kl.horizon} must be >= 1 with "
                "algorithm.kl_ctrl.type=adaptive (samples over which the KL coefficient adapts)"
            )
        if kl.target_kl <= 0:
            raise UserError(
                f"algorithm.kl_ctrl.target_kl={kl.target_kl} must be > 0 with "
                "algorithm.kl_ctrl.type=adaptive"
            )
    if kl.kl_coef < 0:
        raise UserError(f"algorithm.kl_ctrl.kl_coef must be >= 0, got {kl.kl_coef}")


def _check_logging(cfg: RLConfig) -> None:
    """A backend whose package is missing fails now, not after the model is built."""
    from rlcli.run.metrics import wandb_missing_message

    if "wandb" in cfg.logging.backends:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise UserError(wandb_missing_message()) from None


def _check_algorithm_names(cfg: RLConfig) -> None:
    """Names the ``algorithms`` registries declare (estimators, policy losses, KL kinds, loss
    aggregations)."""
    import algorithms

    for key, section in cfg.trained_models:
        if section.loss_agg_mode not in algorithms.LOSS_AGG_MODES:
            raise UserError(
                f"{key}.loss_agg_mode={section.loss_agg_mode!r} is not valid; choose one of: "
                f"{', '.join(algorithms.LOSS_AGG_MODES)}"
            )
    checks = [
        (
            "algorithm.adv_estimator",
            cfg.algorithm.adv_estimator,
            algorithms.get_advantage_estimator,
        ),
        ("actor.policy_loss", cfg.actor.policy_loss, algorithms.get_policy_loss),
        (
            "algorithm.off_policy_correction",
            cfg.algorithm.off_policy_correction,
            algorithms.get_off_policy_correction,
        ),
    ]
    for key, name, lookup in checks:
        try:
            lookup(name)
        except ValueError as err:
            raise UserError(f"{key}: {err}") from None
    for key, kind in (
        ("actor.kl_loss_type", cfg.actor.kl_loss_type),
        ("algorithm.kl_penalty", cfg.algorithm.kl_penalty),
    ):
        if kind.removesuffix("+") not in algorithms.KL_PENALTY_KINDS:  # "k3+": straight-through
            raise UserError(
                f"{key}={kind!r} is not valid; choose one of: "
                f"{', '.join(algorithms.KL_PENALTY_KINDS)}"
            )


def _check_reliability(cfg: RLConfig) -> None:
    """The run-survival limits: non-finite steps, reward failures, restarts, log-prob drift."""
    if cfg.trainer.max_nonfinite_steps < 1:
        raise UserError(
            f"trainer.max_nonfinite_steps must be >= 1, got {cfg.trainer.max_nonfinite_steps}"
        )
    if cfg.trainer.max_restarts is not None and cfg.trainer.max_restarts < 0:
        raise UserError(f"trainer.max_restarts must be >= 0, got {cfg.trainer.max_restarts}")
    if not 0 <= cfg.reward.max_failure_rate <= 1:
        raise UserError(
            f"reward.max_failure_rate must be in [0, 1], got {cfg.reward.max_failure_rate}"
        )
    if not cfg.rollout.max_logprob_diff > 0:
        raise UserError(f"rollout.max_logprob_diff must be > 0, got {cfg.rollout.max_logprob_diff}")
