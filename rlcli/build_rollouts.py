"""The rollout side of ``rlcli.build``: the prompt loader, the engines and rewards, and the two
placements' rollouts (``rlcli.rollouts``): every rank's own engine (colocated), or the trainer's
view of engines on rollout ranks and those ranks' ``RolloutWorker`` (separate)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from rlcli.config import RLConfig
from rlcli.console import say
from rlcli.data import PromptLoader
from rlcli.inputs import RunInputs
from rlcli.rewards import RewardManager
from rlcli.rollout.base import RolloutEngine
from rlcli.rollout_channel import RolloutChannel
from rlcli.rollouts import ColocatedRollouts, Rollouts
from rlcli.sampling import ReplicaInfo
from rlcli.trajectory import response_limit

if TYPE_CHECKING:
    from rlcli.rollout_worker import RolloutWorker


def build_loader(inputs: RunInputs) -> PromptLoader:
    cfg = inputs.cfg
    return PromptLoader(
        inputs.train_data,
        cfg.data.train_batch_size,
        shuffle=cfg.data.shuffle,
        seed=cfg.trainer.seed,
    )


def planned_steps(cfg: RLConfig, loader: PromptLoader) -> int:
    """``trainer.total_steps``, else ``trainer.total_epochs`` over the training prompts."""
    return cfg.trainer.total_steps or cfg.trainer.total_epochs * loader.batches_per_epoch


def build_colocated_rollouts(
    inputs: RunInputs,
    rewards: RewardManager,
    adapters: bool = False,
    engine: tuple[RolloutEngine, ReplicaInfo] | None = None,
) -> ColocatedRollouts:
    """Every rank's own engine (``engine``: one started already, by ``build_engine``);
    ``adapters``: the actor has LoRA adapters (``rollout.lora_sync`` says how they reach the
    engine)."""
    from rlcli.rollout.transport import make_transport

    cfg = inputs.cfg
    if engine is None:
        say(inputs.mesh, f"starting the {cfg.rollout.engine} engine (rollout.tp={cfg.rollout.tp})")
        engine = build_engine(inputs)
    engine, replica = engine
    return ColocatedRollouts(
        cfg,
        engine,
        replica,
        make_transport(cfg.rollout, engine, adapters=adapters),
        rewards,
        inputs.tokenizer,
        inputs.val_data,
    )


def build_streamed_rollouts(inputs: RunInputs, channel: RolloutChannel) -> Rollouts:
    """The trainer's side of engines on their own ranks."""
    from rlcli.rollout.transport import make_transport
    from rlcli.streamed_rollouts import StreamedRollouts

    cfg, roles = inputs.cfg, inputs.roles
    say(
        inputs.mesh,
        f"rollout.placement=separate: ranks 0-{roles.num_trainer_ranks - 1} train, ranks "
        f"{roles.num_trainer_ranks}-{roles.global_size - 1} run the {cfg.rollout.engine} engines "
        f"(rollout.tp={cfg.rollout.tp}); trainer.max_staleness={cfg.trainer.max_staleness}",
    )
    transport = make_transport(cfg.rollout, weights_group=roles.weights)
    return StreamedRollouts(channel, transport, inputs.mesh, cfg.trainer.max_staleness)


def build_rollout_worker(inputs: RunInputs, channel: RolloutChannel) -> RolloutWorker:
    """A rollout rank: its engine (one TP shard of a replica of rollout.tp rollout ranks), the
    rewards, its own loader (set to the trainer's position by the first notice)."""
    from rlcli.rollout.base import rollout_replicas
    from rlcli.rollout.factory import make_engine
    from rlcli.rollout_worker import RolloutWorker

    cfg, roles = inputs.cfg, inputs.roles
    rewards = build_rewards(cfg)
    roles.barrier_all("warm_start")  # the trainer ranks' SFT writes the model the engines load
    if cfg.sft.steps > 0:
        inputs.model_dir = str(inputs.output_dir / "sft_model")
    r = cfg.rollout
    index, count = rollout_replicas(roles.size, roles.rank, r.tp)
    with roles.role_environment():
        engine = make_engine(
            r,
            inputs.model_dir,
            dtype=cfg.model.dtype,
            seed=cfg.trainer.seed,
            max_model_len=r.max_model_len or (cfg.data.max_prompt_length + response_limit(cfg)),
        )
    loader = build_loader(inputs)
    return RolloutWorker(
        cfg=cfg,
        world=roles,
        channel=channel,
        engine=engine,
        replica=ReplicaInfo(index=index, count=count, is_leader=roles.rank % r.tp == 0),
        rewards=rewards,
        tokenizer=inputs.tokenizer,
        loader=loader,
        val_data=inputs.val_data,
        total_steps=planned_steps(cfg, loader),
    )


def build_engine(
    inputs: RunInputs, read_weights: bool = False
) -> tuple[RolloutEngine, ReplicaInfo]:
    """This rank's engine over ``inputs.model_dir``; ``read_weights``: it reads the checkpoint
    whatever ``rollout.load_format`` says (it samples before the trainer's first sync)."""
    from rlcli.rollout.base import rollout_replicas
    from rlcli.rollout.factory import make_engine

    cfg, mesh = inputs.cfg, inputs.mesh
    r = dataclasses.replace(cfg.rollout, load_format="auto") if read_weights else cfg.rollout
    index, count = rollout_replicas(mesh.world_size, mesh.rank, r.tp)
    # A multi-turn trajectory is the prompt and up to max_response_tokens after it.
    adapters = cfg.actor.lora.enable and r.lora_sync == "adapter"
    engine = make_engine(
        r,
        inputs.model_dir,
        dtype=cfg.model.dtype,
        seed=cfg.trainer.seed,  # engines space request seeds per replica themselves
        max_model_len=r.max_model_len or (cfg.data.max_prompt_length + response_limit(cfg)),
        max_lora_rank=cfg.actor.lora.rank if adapters else 0,
    )
    replica = ReplicaInfo(index=index, count=count, is_leader=mesh.rank % r.tp == 0)
    return engine, replica


def build_rewards(cfg: RLConfig) -> RewardManager:
    from rlcli.rewards import default_compute_score, resolve_reward_fn

    fn = (
        resolve_reward_fn(cfg.reward.fn, cfg.reward.kwargs)
        if cfg.reward.fn
        else default_compute_score
    )
    return RewardManager(fn, timeout_s=cfg.reward.timeout_s, num_workers=cfg.reward.num_workers)
