"""Checks on a loaded config that need more than types: choices, relations between keys, and the
parallel layout for a given world size. Every failure is a UserError naming the key."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlcli.errors import UserError

if TYPE_CHECKING:
    from rlcli.config import ParallelConfig, RLConfig


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
    return dp


def validate(cfg: RLConfig, world_size: int | None = None) -> None:
    """Check choices and relations between keys; ``world_size`` also checks the parallel layout."""
    _choice("rollout.engine", cfg.rollout.engine, ["vllm", "hf"])
    _choice("model.dtype", cfg.model.dtype, ["float32", "bfloat16", "float16"])
    _choice("actor.lr_decay_style", cfg.actor.lr_decay_style, ["constant", "linear", "cosine"])
    _choice("actor.recompute", cfg.actor.recompute, ["none", "selective", "full"])
    _choice(
        "model.transformer_impl",
        cfg.model.transformer_impl,
        ["auto", "transformer_engine", "local"],
    )
    _choice("rollout.sleep_level", cfg.rollout.sleep_level, [1, 2])
    _choice("rollout.load_format", cfg.rollout.load_format, ["auto", "dummy"])
    _choice("actor.recompute_method", cfg.actor.recompute_method, ["uniform", "block"])
    _choice("algorithm.kl_ctrl.type", cfg.algorithm.kl_ctrl.type, ["fixed", "adaptive"])
    _choice("data.synthetic", cfg.data.synthetic, [None, "arith"])
    _choice("rollout.logprob_diff_action", cfg.rollout.logprob_diff_action, ["warn", "stop"])
    _check_reliability(cfg)
    _choice(
        "trainer.resume",
        cfg.trainer.resume if cfg.trainer.resume in ("auto", "none") else "path",
        ["auto", "none", "path"],
    )
    for backend in cfg.logging.backends:
        _choice("logging.backends", backend, ["console", "tensorboard", "jsonl", "wandb"])
    _check_algorithm_names(cfg)
    _check_critic(cfg)

    positive = {
        "data.train_batch_size": cfg.data.train_batch_size,
        "data.max_prompt_length": cfg.data.max_prompt_length,
        "rollout.n": cfg.rollout.n,
        "rollout.tp": cfg.rollout.tp,
        "rollout.max_tokens": cfg.rollout.max_tokens,
        "actor.micro_batch_size": cfg.actor.micro_batch_size,
        "actor.ppo_epochs": cfg.actor.ppo_epochs,
        "actor.recompute_num_layers": cfg.actor.recompute_num_layers,
        "critic.micro_batch_size": cfg.critic.micro_batch_size,
        "critic.ppo_epochs": cfg.critic.ppo_epochs,
        "rollout.val_n": cfg.rollout.val_n,
        "sft.batch_size": cfg.sft.batch_size,
        "sft.micro_batch_size": cfg.sft.micro_batch_size,
        "checkpoint.keep_last": cfg.checkpoint.keep_last,
    }
    for key, value in positive.items():
        if value < 1:
            raise UserError(f"{key} must be >= 1, got {value}")
    if cfg.rollout.sync_bucket_mb < 0:
        raise UserError(
            f"rollout.sync_bucket_mb must be >= 0 (0: automatic), got {cfg.rollout.sync_bucket_mb}"
        )
    _check_token_budgets(cfg)
    _choice("actor.old_log_prob_source", cfg.actor.old_log_prob_source, ["actor", "engine"])
    _check_schedules(cfg)
    if cfg.rollout.temperature < 0:
        raise UserError(f"rollout.temperature must be >= 0, got {cfg.rollout.temperature}")
    if not 0 < cfg.rollout.top_p <= 1:
        raise UserError(f"rollout.top_p must be in (0, 1], got {cfg.rollout.top_p}")
    if any(t < 0 for t in cfg.rollout.stop_token_ids):
        raise UserError(
            f"rollout.stop_token_ids must be token ids >= 0, got {cfg.rollout.stop_token_ids}"
        )
    if cfg.rollout.max_model_len is not None:
        need = cfg.data.max_prompt_length + cfg.rollout.max_tokens
        if cfg.rollout.max_model_len < need:
            raise UserError(
                f"rollout.max_model_len={cfg.rollout.max_model_len} is shorter than "
                f"data.max_prompt_length + rollout.max_tokens = {need}"
            )
    mini = cfg.actor.ppo_mini_batch_size
    if mini is not None and (mini < 1 or cfg.data.train_batch_size % mini):
        raise UserError(
            f"actor.ppo_mini_batch_size={mini} must divide data.train_batch_size="
            f"{cfg.data.train_batch_size}"
        )
    if cfg.actor.clip_ratio_c <= 1:
        raise UserError(f"actor.clip_ratio_c must be > 1 (dual-clip), got {cfg.actor.clip_ratio_c}")
    if not cfg.model.path and not cfg.model.build:
        raise UserError("model.path is empty: give a HuggingFace model directory (model.path=DIR)")
    if world_size is not None:
        derive_dp(cfg.parallel, world_size)
        if world_size % cfg.rollout.tp:
            raise UserError(
                f"world size {world_size} is not divisible by rollout.tp={cfg.rollout.tp}"
            )


def _check_token_budgets(cfg: RLConfig) -> None:
    """A budget must hold the longest sequence a step can produce, or that sequence would be cut
    into a micro-batch above the budget (or, packed, not fit at all)."""
    longest = cfg.data.max_prompt_length + cfg.rollout.max_tokens
    for key in ("max_tokens_per_micro_batch", "max_tokens_per_forward"):
        budget = getattr(cfg.actor, key)
        if budget < 0:
            raise UserError(f"actor.{key} must be >= 0 (0: micro_batch_size rows), got {budget}")
        if 0 < budget < longest:
            raise UserError(
                f"actor.{key}={budget} is smaller than the longest sequence it must hold: "
                f"data.max_prompt_length + rollout.max_tokens = {longest}; set it to at least "
                f"{longest} (or 0: micro_batch_size rows)"
            )


def uses_critic(cfg: RLConfig) -> bool:
    """PPO's learned value model: only the ``gae`` estimator reads values."""
    return cfg.algorithm.adv_estimator == "gae"


def _check_critic(cfg: RLConfig) -> None:
    """The critic section, checked only when a critic is trained (other runs ignore it)."""
    c = cfg.critic
    if not uses_critic(cfg):
        if cfg.trainer.critic_warmup:
            raise UserError(
                f"trainer.critic_warmup={cfg.trainer.critic_warmup} needs a critic "
                "(algorithm.adv_estimator=gae); set trainer.critic_warmup=0"
            )
        return
    # megatron-core keeps ONE set of TP / PP process groups per process, so a colocated critic
    # runs in the actor's layout.
    for key, value, actor in (("tp", c.tp, cfg.parallel.tp), ("pp", c.pp, cfg.parallel.pp)):
        if value is not None and value != actor:
            raise UserError(
                f"critic.{key}={value} differs from parallel.{key}={actor}: the critic trains on "
                f"the actor's ranks in the actor's layout; leave critic.{key} unset (or equal)"
            )
    _choice("critic.lr_decay_style", c.lr_decay_style, ["constant", "linear", "cosine"])
    if c.cliprange_value <= 0:
        raise UserError(f"critic.cliprange_value must be > 0, got {c.cliprange_value}")
    if c.lr_warmup_steps < 0:
        raise UserError(f"critic.lr_warmup_steps must be >= 0, got {c.lr_warmup_steps}")
    total = cfg.trainer.total_steps
    if total is not None and c.lr_warmup_steps >= total:
        raise UserError(
            f"critic.lr_warmup_steps={c.lr_warmup_steps} must be smaller than "
            f"trainer.total_steps={total}"
        )
    if cfg.trainer.critic_warmup < 0:
        raise UserError(f"trainer.critic_warmup must be >= 0, got {cfg.trainer.critic_warmup}")
    mini = c.ppo_mini_batch_size
    if mini is not None and (mini < 1 or cfg.data.train_batch_size % mini):
        raise UserError(
            f"critic.ppo_mini_batch_size={mini} must divide data.train_batch_size="
            f"{cfg.data.train_batch_size}"
        )
    import algorithms

    if c.loss_agg_mode not in algorithms.LOSS_AGG_MODES:
        raise UserError(
            f"critic.loss_agg_mode={c.loss_agg_mode!r} is not valid; choose one of: "
            f"{', '.join(algorithms.LOSS_AGG_MODES)}"
        )


def _check_schedules(cfg: RLConfig) -> None:
    """Step counts and controller settings that would otherwise fail deep inside megatron-core's
    LR scheduler or the KL controller, after minutes of work."""
    total = cfg.trainer.total_steps
    if total is not None and total < 1:
        raise UserError(f"trainer.total_steps must be >= 1 (or null: epochs), got {total}")
    for key, value in (
        ("actor.lr_warmup_steps", cfg.actor.lr_warmup_steps),
        ("sft.lr_warmup_steps", cfg.sft.lr_warmup_steps),
        ("sft.steps", cfg.sft.steps),
    ):
        if value < 0:
            raise UserError(f"{key} must be >= 0, got {value}")
    if total is not None and cfg.actor.lr_warmup_steps >= total:
        raise UserError(
            f"actor.lr_warmup_steps={cfg.actor.lr_warmup_steps} must be smaller than "
            f"trainer.total_steps={total} (the warmup is part of the run)"
        )
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


def _choice(key: str, value: Any, valid: list[Any]) -> None:
    if value not in valid:
        shown = ", ".join(repr(v) for v in valid)
        raise UserError(f"{key}={value!r} is not valid; choose one of: {shown}")


def _check_algorithm_names(cfg: RLConfig) -> None:
    import algorithms

    checks = [
        (
            "algorithm.adv_estimator",
            cfg.algorithm.adv_estimator,
            algorithms.get_advantage_estimator,
        ),
        ("actor.policy_loss", cfg.actor.policy_loss, algorithms.get_policy_loss),
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
    if cfg.actor.loss_agg_mode not in algorithms.LOSS_AGG_MODES:
        raise UserError(
            f"actor.loss_agg_mode={cfg.actor.loss_agg_mode!r} is not valid; choose one of: "
            f"{', '.join(algorithms.LOSS_AGG_MODES)}"
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
