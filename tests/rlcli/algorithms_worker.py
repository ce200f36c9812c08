"""Runs one real training step per algorithm variant through the trainer (single process, HF
engine, tiny model) and writes each variant's metrics as JSON. Used by test_algorithms_e2e.py.

Every variant changes only config values, the way a user changes a recipe: the point is that
the trainer needs no code change to run any algorithm in the registry."""

from __future__ import annotations

import json
import sys

import algorithms
from rlcli import components as comp
from rlcli.config_loader import load_config
from rlcli.data import PromptLoader
from rlcli.policy import MegatronPolicy
from rlcli.trainer import Run, rl_step

VARIANTS = {
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
}


def main(recipe: str, out_json: str, *base: str) -> None:
    cfg = load_config(recipe, list(base))
    c = comp.prepare_inputs(cfg)
    actor = comp.build_actor(c, total_steps=len(VARIANTS))
    ref = MegatronPolicy(c.mesh, c.model_dir, cfg.model.dtype)
    engine, replica = comp.build_engine(c)
    rewards = comp.build_rewards(cfg)
    results = {}
    for name, overrides in VARIANTS.items():
        variant = load_config(recipe, [*base, *overrides])
        variant.data = cfg.data  # the resolved file lists
        c.cfg = variant
        kl = variant.algorithm.kl_ctrl
        run = Run(
            c=c,
            actor=actor,
            ref=ref if comp.needs_reference(variant) else None,
            engine=engine,
            replica=replica,
            rewards=rewards,
            loader=PromptLoader(c.train_data, variant.data.train_batch_size, seed=1),
            kl_ctrl=algorithms.get_kl_controller(kl.type, kl.kl_coef, kl.target_kl, kl.horizon),
            total_steps=1,
            step=len(results),
        )
        results[name] = rl_step(run)
    rewards.close()
    with open(out_json, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *sys.argv[3:])
