"""The rollout side of ``rlcli.train.build``: the prompt loader, the sampler (engine, rewards, agent
loop) and the two placements' rollouts (``rlcli.rollout.placement``): every rank's own engine
(colocated), or the trainer's view of engines on rollout ranks and those ranks'
``RolloutWorker`` (separate)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from rlcli.config.schema import RLConfig
from rlcli.console import say
from rlcli.data import PromptLoader
from rlcli.rewards import RewardManager
from rlcli.rollout.agent_loop import AgentLoop, build_agent_loop
from rlcli.rollout.channel import RolloutChannel
from rlcli.rollout.placement import ColocatedRollouts, Rollouts
from rlcli.rollout.sampling import Sampler
from rlcli.rollout.trajectory import response_limit
from rlcli.train.inputs import RunInputs, tokenizer_setting

if TYPE_CHECKING:
    from rlcli.rollout.worker import RolloutWorker


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


def build_agent_loop_of(inputs: RunInputs, samples_here: bool = True) -> AgentLoop | None:
    """The run's agent loop (``rollout.multi_turn``; None without); ``samples_here=False``: for
    checks only, on ranks that never sample (no replica process groups)."""
    cfg = inputs.cfg
    tp = cfg.rollout.tp if samples_here else 1
    return build_agent_loop(cfg.rollout.multi_turn, inputs.tokenizer, tokenizer_setting(cfg), tp)


def build_sampler(
    inputs: RunInputs,
    rewards: RewardManager,
    agent: AgentLoop | None,
    read_weights: bool = False,
) -> Sampler:
    """This rank's sampler: its engine over ``inputs.model_dir`` (a TP shard of a replica of
    ``rollout.tp`` ranks of the engines' world), with ``rewards`` and ``agent``;
    ``read_weights``: the engine reads the checkpoint whatever ``rollout.load_format`` says (it
    samples before the trainer's first sync)."""
    from rlcli.rollout.agents.runner import build_agent_rollout
    from rlcli.rollout.factory import make_engine

    cfg = inputs.cfg
    r = dataclasses.replace(cfg.rollout, load_format="auto") if read_weights else cfg.rollout
    adapters = cfg.actor.lora.enable and r.lora_sync == "adapter"
    # A multi-turn trajectory is the prompt and up to max_response_tokens after it.
    max_model_len = r.max_model_len or (cfg.data.max_prompt_length + response_limit(cfg))
    engine = make_engine(
        r,
        inputs.model_dir,
        dtype=r.engine_dtype(cfg.model.dtype),
        seed=cfg.trainer.seed,  # engines space request seeds per replica themselves
        max_model_len=max_model_len,
        max_lora_rank=cfg.actor.lora.rank if adapters else 0,
    )
    agents = build_agent_rollout(r, inputs.tokenizer, tokenizer_setting(cfg), max_model_len)
    return Sampler(cfg, engine, rewards, inputs.tokenizer, agent, agents)


def build_colocated_rollouts(
    inputs: RunInputs,
    rewards: RewardManager,
    agent: AgentLoop | None,
    adapters: bool = False,
    sampler: Sampler | None = None,
) -> ColocatedRollouts:
    """Every rank's own sampler (``sampler``: one started already, by ``rm.on_policy_samples``;
    else built here from ``rewards`` and ``agent``); ``adapters``: the actor has LoRA adapters
    (``rollout.lora_sync`` says how they reach the engine)."""
    from rlcli.rollout.transport import make_transport

    cfg = inputs.cfg
    if sampler is None:
        say(inputs.mesh, f"starting the {cfg.rollout.engine} engine (rollout.tp={cfg.rollout.tp})")
        sampler = build_sampler(inputs, rewards, agent)
    transport = make_transport(cfg.rollout, sampler.engine, adapters=adapters)
    return ColocatedRollouts(sampler, transport, inputs.val_data)


def build_streamed_rollouts(inputs: RunInputs, channel: RolloutChannel) -> Rollouts:
    """The trainer's side of engines on their own ranks."""
    from rlcli.rollout.streamed import StreamedRollouts
    from rlcli.rollout.transport import make_transport

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
    """A rollout rank: its sampler (its engine one TP shard of a replica of rollout.tp rollout
    ranks), its own loader (set to the trainer's position by the first notice)."""
    from rlcli.rollout.worker import RolloutWorker

    cfg, roles = inputs.cfg, inputs.roles
    rewards = build_rewards(cfg)
    roles.barrier_all("warm_start")  # the trainer ranks' SFT writes the model the engines load
    if cfg.sft.steps > 0:
        inputs.model_dir = str(inputs.output_dir / "sft_model")
    agent = build_agent_loop_of(inputs)
    with roles.role_environment():
        sampler = build_sampler(inputs, rewards, agent)
    loader = build_loader(inputs)
    return RolloutWorker(
        cfg=cfg,
        world=roles,
        channel=channel,
        sampler=sampler,
        loader=loader,
        val_data=inputs.val_data,
        total_steps=planned_steps(cfg, loader),
    )


def build_rewards(cfg: RLConfig) -> RewardManager:
    from rlcli.rewards import default_compute_score, resolve_reward_fn

    fn = (
        resolve_reward_fn(cfg.reward.fn, cfg.reward.kwargs)
        if cfg.reward.fn
        else default_compute_score
    )
    return RewardManager(fn, timeout_s=cfg.reward.timeout_s, num_workers=cfg.reward.num_workers)
