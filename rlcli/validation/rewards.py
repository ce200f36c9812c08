"""Checks on the model-based reward sections (``reward.model``, ``reward.judge``,
``reward.combine``) and on ``rm.*`` (training a reward model): relations between keys, what the
model rewards cannot run with, and the model folders when a run starts. Every failure is a
UserError naming the key (see ``rlcli.validation.validate``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlcli.errors import UserError
from rlcli.validation.model import check_hf_engine, check_packing

if TYPE_CHECKING:
    from rlcli.config.schema import RLConfig


def check_model_rewards(cfg: RLConfig, world_size: int | None) -> None:
    """``reward.model`` / ``reward.judge`` / ``reward.combine`` and what they cannot run with
    (the folders themselves are checked when a run starts: ``check_reward_model_dirs``)."""
    m, j = cfg.reward.model, cfg.reward.judge
    if cfg.rm.before_rl and m.path != cfg.rm.out_dir:
        raise UserError(
            f"rm.before_rl=true trains the reward model into rm.out_dir={cfg.rm.out_dir}, but "
            f"reward.model.path={m.path!r}: set reward.model.path to rm.out_dir"
        )
    if not cfg.reward.uses_model_reward:
        return
    if m.path and m.micro_batch_size < 1:
        raise UserError(f"reward.model.micro_batch_size must be >= 1, got {m.micro_batch_size}")
    if m.path and m.max_tokens_per_forward < 0:
        raise UserError(
            f"reward.model.max_tokens_per_forward must be >= 0, got {m.max_tokens_per_forward}"
        )
    if m.path:
        check_packing("reward.model", m.pack_sequences, cfg)
    if cfg.algorithm.adv_estimator == "remax":
        raise UserError(
            "algorithm.adv_estimator=remax scores its greedy baselines inside the rollout, where "
            "reward.model / reward.judge do not run: choose another estimator (grpo, rloo, ...)"
        )
    dyn = cfg.algorithm.dynamic_sampling
    if dyn.enabled and dyn.max_gen_batches != 1:
        raise UserError(
            f"algorithm.dynamic_sampling.max_gen_batches={dyn.max_gen_batches}: with "
            "reward.model / reward.judge, DAPO's filter runs on the combined reward after the "
            "rollout and cannot draw more prompts; set it to 1"
        )
    if j.path:
        _check_judge(cfg, world_size)


def _check_judge(cfg: RLConfig, world_size: int | None) -> None:
    from rlcli.rewards.judge import JudgeScoreParser, judge_template

    j = cfg.reward.judge
    judge_template(j)  # checks the template
    JudgeScoreParser.of(j)  # checks the parser settings (UserError naming reward.judge.<key>)
    check_hf_engine("reward.judge", j)
    for key in ("tp", "max_tokens"):
        if getattr(j, key) < 1:
            raise UserError(f"reward.judge.{key} must be >= 1, got {getattr(j, key)}")
    if j.temperature < 0:
        raise UserError(f"reward.judge.temperature must be >= 0, got {j.temperature}")
    if world_size is not None and world_size % j.tp:
        raise UserError(f"world size {world_size} is not divisible by reward.judge.tp={j.tp}")
    if j.engine == "vllm" and cfg.rollout.engine == "vllm":
        # Both engines live in one process and share vLLM's process-wide state: its parallel
        # groups, and on GPU its sleep-mode allocator (a level-2 sleep of the policy's engine
        # would discard the judge's weights too).
        if j.tp != cfg.rollout.tp:
            raise UserError(
                f"reward.judge.tp={j.tp} must equal rollout.tp={cfg.rollout.tp}: two vLLM "
                "engines in one process share vLLM's tensor-parallel groups"
            )
        if cfg.rollout.sleep_level != 1:
            raise UserError(
                "rollout.sleep_level=2 with a vLLM judge: vLLM's sleep allocator is shared by "
                "every engine of a process, so the policy's level-2 sleep would discard the "
                "judge's weights; use rollout.sleep_level=1"
            )


def check_reward_model_dirs(cfg: RLConfig) -> None:
    """The model folders of ``reward.model.path`` (a one-label sequence-classification model,
    unless ``rm.before_rl`` will write it) and ``reward.judge.path`` (an HF model folder).
    The checks import megatron-core: only when there is a folder to check (``rlcli train --nproc
    N`` runs this before it starts torchrun, and needs megatron-core for nothing else)."""
    if cfg.reward.model.path and not cfg.rm.before_rl:
        from rlcli.reward_models.reward_model import check_reward_model_path

        check_reward_model_path(cfg.reward.model.path)
    if cfg.reward.judge.path:
        from parallel.convert import hf_model_dir_problem

        problem = hf_model_dir_problem(cfg.reward.judge.path)
        if problem is not None:
            raise UserError(f"reward.judge.path={cfg.reward.judge.path}: {problem}")


def check_reward_model_training(cfg: RLConfig, dp: int) -> None:
    """The ``rm.*`` settings of ``rlcli rm`` (checked only when a reward model is trained, so a
    recipe that never trains one is not held to them)."""
    rm = cfg.rm
    for key in ("steps", "batch_size", "micro_batch_size", "max_length"):
        if getattr(rm, key) < 1:
            raise UserError(f"rm.{key} must be >= 1, got {getattr(rm, key)}")
    for key in ("max_tokens", "lr_warmup_steps", "val_freq", "save_freq", "grad_clip", "lr"):
        if getattr(rm, key) < 0:
            raise UserError(f"rm.{key} must be >= 0, got {getattr(rm, key)}")
    if rm.on_policy_samples < 0:
        raise UserError(f"rm.on_policy_samples must be >= 0, got {rm.on_policy_samples}")
    if rm.on_policy_samples and cfg.rollout.multi_turn.enable:
        raise UserError(
            "rm.on_policy_samples grades single-turn answers; with rollout.multi_turn.enable "
            "give the pairs as rm.train_files, or set rm.on_policy_samples=0"
        )
    if rm.lr_warmup_steps >= rm.steps:
        raise UserError(
            f"rm.lr_warmup_steps={rm.lr_warmup_steps} must be smaller than rm.steps={rm.steps}"
        )
    if rm.batch_size % dp:
        raise UserError(
            f"rm.batch_size={rm.batch_size} must divide evenly over the {dp} data-parallel "
            "replicas (world size / (parallel.tp * parallel.pp))"
        )
    if not rm.synthetic and not rm.train_files:
        raise UserError(
            "rm.train_files is empty: give JSONL / Parquet preference rows "
            "({prompt, chosen, rejected}) or set rm.synthetic=arith"
        )
