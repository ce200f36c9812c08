"""Runs real steps of a PPO trainer whose actor, critic and reference all leave the device between
phases (single process, HF engine, tiny model), recording after each phase what every model holds
on the device and every byte that moved. Used by test_residency.py.

    residency_worker.py RECIPE OUT_JSON OVERRIDES...

Steps: 1 (``trainer.critic_warmup=1``: the actor's update is skipped), 2 (every phase), and a
step where DAPO keeps no group (every reward equal), which skips everything after the rollout.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from rlcli.model.residency import KINDS
from rlcli.process_lifetime import exit_skipping_teardown
from rlcli.train.build import build_rewards, build_trainer
from rlcli.train.trainer import rl_step
from rlcli.validation.loader import load_config

PPO_ALL_OFFLOADED = [
    "algorithm.adv_estimator=gae",
    "trainer.critic_warmup=1",
    "actor.use_kl_loss=true",  # a reference model
    "actor.ppo_mini_batch_size=2",  # two mini-batches: the old-log-prob phase runs
    *(f"{m}.offload_{kind}=true" for m in ("actor", "critic") for kind in KINDS),
    "ref.offload=true",
]
CONSTANT_REWARD = Path(__file__).with_name("constant_reward.py")


class Recorder:
    """Wraps a trainer's residency and models: the phase entered, then each model's resident
    kinds, and every offload / onload with its bytes."""

    def __init__(self) -> None:
        self.phases: list[dict] = []
        self.moves: list[dict] = []
        self.phase = "(outside a phase)"

    def watch(self, trainer) -> None:
        residency = trainer.residency
        enter = residency.enter

        def entering(phase: str):
            self.phase = phase
            moved = enter(phase)
            names = residency.models
            self.phases.append(
                {"phase": phase, **{n: sorted(residency.on_device(n)) for n in names}}
            )
            return moved

        residency.enter = entering
        for name, model in residency.models.items():
            for direction in ("offload", "onload"):
                self._wrap(model, name, direction)

    def _wrap(self, model, name: str, direction: str) -> None:
        original = getattr(type(model), direction).__get__(model)
        if getattr(getattr(model, direction), "recorded", False):
            return

        def moving(**kinds: bool):
            stats = original(**kinds)
            self.moves.append(
                {
                    "phase": self.phase,
                    "model": name,
                    "direction": direction,
                    "kinds": sorted(k for k, wanted in kinds.items() if wanted),
                    "bytes": stats.bytes,
                }
            )
            return stats

        moving.recorded = True
        setattr(model, direction, moving)

    def take(self) -> tuple[list[dict], list[dict]]:
        phases, moves = self.phases, self.moves
        self.phases, self.moves = [], []
        return phases, moves


def main(recipe: str, out_json: str, *base: str) -> None:
    cfg = load_config(recipe, [*base, *PPO_ALL_OFFLOADED])
    trainer = build_trainer(cfg, logger=False)
    recorder = Recorder()
    recorder.watch(trainer)
    steps = {}
    for step in (1, 2):
        trainer.step = step
        metrics = rl_step(trainer)
        phases, moves = recorder.take()
        steps[str(step)] = {"metrics": metrics, "phases": phases, "moves": moves}

    variant = load_config(
        recipe,
        [
            *base,
            *PPO_ALL_OFFLOADED,
            "algorithm.dynamic_sampling.enabled=true",
            "algorithm.dynamic_sampling.max_gen_batches=1",
            f"reward.fn={CONSTANT_REWARD}:compute_score",
        ],
    )
    variant.data = cfg.data  # the resolved file lists
    rewards = build_rewards(variant)
    sampler = dataclasses.replace(trainer.rollouts.sampler, cfg=variant, rewards=rewards)
    rollouts = dataclasses.replace(trainer.rollouts, sampler=sampler)
    dapo = dataclasses.replace(trainer, cfg=variant, rollouts=rollouts, step=3)
    recorder.watch(dapo)
    metrics = rl_step(dapo)
    phases, moves = recorder.take()
    steps["dapo_skip"] = {"metrics": metrics, "phases": phases, "moves": moves}
    rewards.close()
    trainer.rollouts.sampler.rewards.close()
    with open(out_json, "w") as f:
        json.dump(steps, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *sys.argv[3:])
    exit_skipping_teardown()  # (2 s of interpreter teardown a rank)
