"""Runs one real training step per algorithm variant through the trainer (single process, HF
engine, tiny model) and writes each variant's metrics as JSON. Used by test_algorithms_e2e.py.

Every variant changes only config values, the way a user changes a recipe: the point is that
the trainer needs no code change to run any algorithm in the registry."""

from __future__ import annotations

import dataclasses
import json
import sys

from rlcli.data import PromptLoader
from rlcli.process_lifetime import exit_skipping_teardown
from rlcli.rollout.hf_engine import HFEngine
from rlcli.train.build import build_kl_controller, build_trainer, needs_reference
from rlcli.train.teacher import TeacherEngine
from rlcli.train.trainer import rl_step, sync_rollout_weights
from rlcli.validation.loader import load_config

# On-policy distillation with the reference (the start weights) as the teacher: first, while the
# actor still equals it (no signal, no update), and again once the actor has moved.
DISTILL = ["distill.enable=true", "distill.teacher_path=${model.path}"]
SAME_TEACHER = "distill_teacher_equals_student"

ENGINE_TEACHER = "distill_hf_engine_teacher_equals_student"
TOP_K = ["distill.objective=topk_forward_kl", "distill.top_k=8"]
TOP_K_SAME_TEACHER = "distill_topk_teacher_equals_student"
TOP_K_ENGINE_TEACHER = "distill_topk_hf_engine_teacher_equals_student"

VARIANTS = {
    SAME_TEACHER: DISTILL,
    # the same teacher on the HF engine (prompt log-probs, before the samples are shared out)
    ENGINE_TEACHER: [*DISTILL, "distill.teacher.engine=hf"],
    # the teacher's top 8 tokens per position, a loss of the update (one optimizer step: its
    # gradient is what the two passes' rounding leaves)
    TOP_K_SAME_TEACHER: [*DISTILL, *TOP_K, "actor.ppo_mini_batch_size=4"],
    TOP_K_ENGINE_TEACHER: [
        *DISTILL,
        *TOP_K,
        "distill.teacher.engine=hf",
        "actor.ppo_mini_batch_size=4",
    ],  # fmt: skip
    "grpo": [],
    "drgrpo": ["algorithm.norm_adv_by_std=false", "actor.loss_agg_mode=seq-mean-token-sum-norm"],
    "rloo": ["algorithm.adv_estimator=rloo"],
    "reinforce_plus_plus": ["algorithm.adv_estimator=reinforce_plus_plus"],
    "reinforce_plus_plus_baseline": ["algorithm.adv_estimator=reinforce_plus_plus_baseline"],
    "remax": ["algorithm.adv_estimator=remax"],
    "opo": ["algorithm.adv_estimator=opo"],
    "gpg": ["algorithm.adv_estimator=gpg"],
    "gspo": ["actor.policy_loss=gspo", "actor.loss_agg_mode=seq-mean-token-mean"],
    "cispo": ["actor.policy_loss=cispo"],
    "clip_cov": ["actor.policy_loss=clip_cov"],
    "kl_cov": ["actor.policy_loss=kl_cov"],
    "dapo": [
        "actor.clip_ratio_high=0.28",
        "algorithm.dynamic_sampling.enabled=true",
        "algorithm.dynamic_sampling.max_gen_batches=3",
        "algorithm.overlong.enabled=true",
        "algorithm.overlong.buffer_len=4",
    ],
    "kl_loss": ["actor.use_kl_loss=true", "actor.kl_loss_coef=0.1", "actor.entropy_coeff=0.01"],
    "kl_in_reward": ["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive"],
    # Throughput settings: an on-policy update (one mini-batch: no old-log-prob pass), the
    # engine's log-probs as old log-probs, a token budget with two PPO epochs (so the separate
    # old-log-prob pass runs with its own forward budget).
    "on_policy": ["actor.ppo_mini_batch_size=4"],
    "engine_old_log_probs": ["actor.old_log_prob_source=engine"],
    # Rollout correction in the synchronous placement (the engine as the behaviour policy).
    "seq_is_geo": ["algorithm.off_policy_correction=seq_is_geo"],
    "token_mis": ["algorithm.off_policy_correction=token_mis"],
    "distill": [*DISTILL, "distill.reward_weight=0.5"],
    "distill_topk": [*DISTILL, *TOP_K],
    "token_budget_two_epochs": [
        "actor.ppo_mini_batch_size=4",
        "actor.ppo_epochs=2",
        "actor.max_tokens_per_micro_batch=64",
        "actor.max_tokens_per_forward=128",
    ],
}


def actor_weights(trainer) -> list:
    return [p.detach().clone() for model in trainer.actor.models for p in model.parameters()]


def restore_actor_weights(trainer, weights: list) -> None:
    params = [p for model in trainer.actor.models for p in model.parameters()]
    for param, saved in zip(params, weights, strict=True):
        param.data.copy_(saved)


def main(recipe: str, out_json: str, *base: str) -> None:
    cfg = load_config(recipe, list(base))
    # One trainer from the factory (with a reference, which some variants need); each variant
    # is the same trainer with another config, as a user would write another recipe.
    trainer = build_trainer(cfg, reference=True, logger=False)
    engine_teacher = TeacherEngine(HFEngine(trainer.model_dir))
    results = {}
    for name, overrides in VARIANTS.items():
        variant = load_config(recipe, [*base, *overrides])
        variant.data = cfg.data  # the resolved file lists
        engine = variant.distill.teacher.engine if variant.distill.enable else None
        run = dataclasses.replace(
            trainer,
            cfg=variant,
            rollouts=dataclasses.replace(
                trainer.rollouts, sampler=dataclasses.replace(trainer.rollouts.sampler, cfg=variant)
            ),
            reference=trainer.reference if needs_reference(variant) else None,
            teacher=trainer.reference if engine == "megatron" else None,
            teacher_engine=(
                TeacherEngine(engine_teacher.engine, variant.distill.teacher_top_k)
                if engine in ("hf", "vllm")
                else None
            ),
            loader=PromptLoader(trainer.loader.dataset, variant.data.train_batch_size, seed=1),
            kl_ctrl=build_kl_controller(variant),
            total_steps=1,
            step=len(results),
        )
        before = actor_weights(trainer)
        results[name] = rl_step(run)
        change = max(
            (a - b).abs().max().item() for a, b in zip(before, actor_weights(trainer), strict=True)
        )
        results[name]["check/max_weight_change"] = change
        if name in (TOP_K_SAME_TEACHER, TOP_K_ENGINE_TEACHER):
            # Adam turns even a rounding-sized gradient into a step of about lr: put the start
            # weights back (in the rollout engine too), so that the next variant's teacher (the
            # start weights) still equals the student.
            restore_actor_weights(trainer, before)
            sync_rollout_weights(trainer)
    trainer.rollouts.sampler.rewards.close()
    with open(out_json, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *sys.argv[3:])
    exit_skipping_teardown()  # (2 s of interpreter teardown a rank)
