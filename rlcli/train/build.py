"""The one factory: config -> ``Trainer`` (``rlcli train``), or an SFT-only run (``rlcli sft``).

Every rank builds the same things in the same order: rewards (a reward spec that does not import
fails at once), inputs (process groups, data, model), the SFT warm start, the reward-model stage
(``rm.before_rl``; with ``rm.on_policy_samples`` it starts the rollout sampler, which the
rollouts then keep), the actor, the reference, distillation's teacher, PPO's critic, the rollout sampler (engine, rule
rewards, agent loop), the model rewards (reward model, judge), then resumes from the newest
checkpoint when asked.
With ``rollout.placement=separate`` (``run_role``) the trainer ranks build all of that but the
engine and the rewards; the rollout ranks build only those (``RolloutWorker``). The rollout
side's builders are ``rlcli.train.build_rollouts``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import algorithms
from rlcli.config.schema import RLConfig, to_dict
from rlcli.console import say
from rlcli.errors import UserError
from rlcli.model.heads import ValueHead
from rlcli.model.lora import lora_spec
from rlcli.model.trained_model import LoraReference, MicroBatching, TrainedModel, optimizer_settings
from rlcli.rollout.channel import RolloutChannel, RunEnded
from rlcli.run.checkpoints import CheckpointManager, checkpoint_root
from rlcli.run.metrics import MetricsLogger
from rlcli.run.resume_plan import record_warm_start, warm_start_changes
from rlcli.train.advantages import KLController
from rlcli.train.build_rollouts import (
    build_agent_loop_of,
    build_colocated_rollouts,
    build_loader,
    build_rewards,
    build_rollout_worker,
    build_sampler,
    build_streamed_rollouts,
    planned_steps,
)
from rlcli.train.inputs import RunInputs, model_options, prepare_inputs
from rlcli.train.save_resume import CheckpointedModel, RunCheckpoints, replacing_folder
from rlcli.train.teacher import build_teacher, build_teacher_engine
from rlcli.train.trainer import Trainer

if TYPE_CHECKING:
    from rlcli.rewards import RewardManager
    from rlcli.rollout.agent_loop import AgentLoop
    from rlcli.rollout.sampling import Sampler


def run_role(cfg: RLConfig) -> None:
    """What ``rlcli train`` runs on every rank: the trainer; with ``rollout.placement=separate``
    the rollout ranks run the rollout worker instead. A failure on either side ends the other
    side's waits with the same message."""
    inputs = prepare_inputs(cfg)
    channel = None
    if inputs.roles is not None:
        channel = RolloutChannel(inputs.roles, timeout_s=cfg.parallel.timeout_minutes * 60)
    try:
        if inputs.roles is not None and not inputs.roles.is_trainer:
            build_rollout_worker(inputs, channel).fit()
        else:
            build_trainer(cfg, inputs=inputs, channel=channel).fit()
    except RunEnded:
        return  # a rollout rank: the trainer failed and says why
    except BaseException as error:
        if channel is not None:
            channel.report_failure(error)
        raise
    if inputs.roles is not None:  # the launch's store lives in trainer rank 0's process
        inputs.roles.barrier_all("end")


def build_trainer(
    cfg: RLConfig,
    reference: bool | None = None,
    logger: bool = True,
    inputs: RunInputs | None = None,
    channel: RolloutChannel | None = None,
) -> Trainer:
    """Everything a run needs, from the config. ``reference`` forces building the reference
    model (default: only when a KL term uses it); ``logger=False`` builds no metrics logger.
    ``inputs`` / ``channel``: already prepared (``run_role``)."""
    separate = cfg.rollout.is_separate
    rewards = None if separate else build_rewards(cfg)
    inputs = inputs or prepare_inputs(cfg)
    agent = check_multi_turn(inputs)
    if inputs.mesh is None:
        raise RuntimeError("a rollout rank builds a RolloutWorker, not a Trainer (run_role)")
    if cfg.sft.steps > 0:
        inputs.model_dir = str(warm_start(inputs))
    sampler = reward_model_stage(inputs, rewards, agent) if cfg.rm.before_rl else None
    if inputs.roles is not None:  # the rollout ranks wait for the model the engines load
        inputs.roles.barrier_all("warm_start")
    loader = build_loader(inputs)
    total = planned_steps(cfg, loader)
    mesh = inputs.mesh
    say(mesh, f"building actor (tp={mesh.tp} pp={mesh.pp} dp={mesh.dp}) from {inputs.model_dir}")
    actor = build_actor(inputs, total_steps=total)
    ref = None
    if needs_reference(cfg) if reference is None else reference:
        ref = build_reference(inputs, actor)
    teacher = teacher_engine = None
    if cfg.distill.enable and cfg.distill.teacher.engine == "megatron":
        teacher = build_teacher(inputs, model_options(cfg))
    elif cfg.distill.enable:
        teacher_engine = build_teacher_engine(inputs)
    critic = build_critic(inputs, total_steps=total) if cfg.algorithm.uses_critic else None
    if separate:
        channel = channel or RolloutChannel(inputs.roles, cfg.parallel.timeout_minutes * 60)
        rollouts = build_streamed_rollouts(inputs, channel)
    else:
        rollouts = build_colocated_rollouts(
            inputs, rewards, agent, adapters=actor.lora is not None, sampler=sampler
        )
    from rlcli.reward_models.model_rewards import build_model_rewards

    model_rewards = build_model_rewards(cfg, mesh, inputs.tokenizer, model_options(cfg))
    trainer = Trainer(
        cfg=cfg,
        mesh=mesh,
        tokenizer=inputs.tokenizer,
        model_dir=inputs.model_dir,
        actor=actor,
        reference=ref,
        rollouts=rollouts,
        loader=loader,
        kl_ctrl=build_kl_controller(cfg),
        checkpoints=rl_checkpoints(cfg, actor, critic, inputs.model_dir),
        logger=None,
        total_steps=total,
        critic=critic,
        teacher=teacher,
        teacher_engine=teacher_engine,
        model_rewards=model_rewards,
        settings=inputs.settings,
    )
    gigabytes, seconds = trainer.residency.reserve_host_buffers()
    gigabytes /= 1e9
    if gigabytes:
        say(
            mesh, f"offload: {gigabytes:.2f} GB of pinned host buffers allocated in {seconds:.2f} s"
        )
    resumed = trainer.checkpoints.resume(cfg.trainer.resume)
    if resumed is not None:
        state = resumed.state
        if state.loader is None or state.kl_coef is None:
            raise UserError(
                f"trainer.resume: {resumed.path} is not an RL run's checkpoint (no data position "
                "or KL coefficient); resume it with the command that wrote it"
            )
        loader.load_state_dict(state.loader)
        trainer.kl_ctrl.value = state.kl_coef
        if model_rewards is not None:
            model_rewards.load_state_dict(state.model_rewards or {})
        trainer.step = trainer.resumed_from = state.step
    if logger:
        restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
        # A group torchrun restarted before any checkpoint starts over: drop the dead attempt's
        # rows past step 0 so every step is logged once.
        resumed = 0 if restarted and trainer.resumed_from is None else trainer.resumed_from
        trainer.logger = build_logger(inputs, total, resumed)
    return trainer


def rl_checkpoints(
    cfg: RLConfig, actor: TrainedModel, critic: TrainedModel | None, model_dir: str
) -> RunCheckpoints:
    """An RL run's checkpoints (``checkpoint.*``): the actor with the HF folder it trained from,
    and PPO's critic with its own."""
    models = [CheckpointedModel("model", actor, hf_dir=model_dir, role="the actor")]
    if critic is not None:
        models.append(
            CheckpointedModel(
                "critic/model",
                critic,
                hf_dir=critic.hf_dir,
                role="PPO's value model (critic)",
                absent_because="it was written by a run without algorithm.adv_estimator=gae",
            )
        )
    return RunCheckpoints(
        CheckpointManager(
            checkpoint_root(cfg.checkpoint.dir, cfg.trainer.output_dir),
            keep_last=cfg.checkpoint.keep_last,
        ),
        models,
        save_optimizer=cfg.checkpoint.save_optimizer,
        fix="Lower actor.lr, keep actor.grad_clip > 0, or use model.dtype=float32 / bfloat16 "
        "instead of float16.",
    )


def check_multi_turn(inputs: RunInputs) -> AgentLoop | None:
    """Build the multi-turn rollout's agent loop now (its tools and environment: the python tool
    probes its sandbox), and check every row's ``extra_info.tools_kwargs``: a mistake stops the
    run before the model is built, naming the tool config or the row. Returns it for this rank's
    sampler (None without multi-turn, or on trainer ranks whose engines run elsewhere)."""
    separate = inputs.cfg.rollout.is_separate
    agent = build_agent_loop_of(inputs, samples_here=not separate)
    if agent is not None:
        agent.check_items([*inputs.train_data, *(inputs.val_data or [])])
        if separate:  # the rollout ranks build their own
            agent.close()
            return None
    return agent


def run_sft_only(cfg: RLConfig) -> Path:
    if cfg.rollout.is_separate:
        raise UserError(
            "rlcli sft trains on every process; rollout.placement=separate is rlcli train's "
            "(set rollout.placement=colocated and rollout.num_ranks=0 for the SFT run)"
        )
    return warm_start(prepare_inputs(cfg), force=True)


def warm_start(inputs: RunInputs, force: bool = False) -> Path:
    """SFT into ``<output_dir>/sft_model`` unless it is already there; RL starts from it."""
    from rlcli.train.sft import sft_warm_start

    cfg, mesh = inputs.cfg, inputs.mesh
    out = inputs.output_dir / "sft_model"
    changes = None
    if (out / "config.json").exists() and not force:
        changes = warm_start_changes(out, inputs.settings)
        if changes is None:
            say(mesh, f"warm start: reusing {out} (made with the same settings)")
            return out
        say(mesh, f"warm start: training {out} again, from scratch: {changes}")
    files = list(cfg.sft.train_files) or inputs.sft_files
    say(mesh, f"warm start: {cfg.sft.steps} SFT steps on {', '.join(files)}")
    # a crash mid-save leaves only sft_model.tmp, never a partial sft_model
    with replacing_folder(out, mesh.rank) as staging:
        sft_warm_start(
            inputs,
            lambda: build_actor(inputs, total_steps=cfg.sft.steps, sft=True),
            files,
            staging,
            log=lambda m: say(mesh, m),
            fresh=changes is not None,  # its checkpoints are the old settings' warm start
        )
        if mesh.rank == 0:
            record_warm_start(staging, inputs.settings)
    return out


def reward_model_stage(
    inputs: RunInputs, rewards: RewardManager | None, agent: AgentLoop | None
) -> Sampler | None:
    """``rm.before_rl``: train a reward model as ``rlcli rm`` does into ``rm.out_dir``, from
    ``rm.init_path`` or the RL start model (the SFT policy), unless one is there already. With
    ``rm.on_policy_samples`` the RL start policy's graded samples add pairs; returns the sampler
    that drew them (the rollouts' from then on), else None."""
    from rlcli.train.reward_model import train_reward_model

    cfg, mesh = inputs.cfg, inputs.mesh
    out = Path(cfg.rm.out_dir)
    if (out / "config.json").exists():
        say(mesh, f"reward model: reusing {out}")
        return None
    sampler, extra_pairs = None, ([], [])
    if cfg.rm.on_policy_samples:
        from rlcli.train.on_policy_pairs import write_on_policy_pairs

        say(mesh, f"starting the {cfg.rollout.engine} engine for on-policy preference pairs")
        sampler = build_sampler(inputs, rewards, agent, read_weights=True)
        extra_pairs = write_on_policy_pairs(inputs, sampler, lambda m: say(mesh, m))
    start = cfg.rm.init_path or inputs.model_dir
    say(mesh, f"reward model: {cfg.rm.steps} Bradley-Terry steps from {start} into {out}")
    report = train_reward_model(
        cfg,
        mesh,
        model_options(cfg, cfg.actor),
        log=lambda m: say(mesh, m),
        init_path=start,
        extra_pairs=extra_pairs,
    )
    if report.val_accuracy_after is not None:
        before = report.val_accuracy_before
        say(
            mesh,
            "reward model held-out pairwise accuracy "
            + ("n/a" if before is None else f"{before:.3f}")
            + f" -> {report.val_accuracy_after:.3f} ({report.val_pairs} pairs)",
        )
    return sampler


def build_actor(inputs: RunInputs, total_steps: int, sft: bool = False) -> TrainedModel:
    """The policy, trainable: ``actor.*`` (the SFT warm start: its own lr, warmup and
    micro-batch size)."""
    cfg = inputs.cfg
    settings = optimizer_settings(
        cfg.actor,
        total_steps=total_steps,
        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
        lr=cfg.sft.lr if sft else None,
        warmup_steps=cfg.sft.lr_warmup_steps if sft else None,
    )
    micro_batching = MicroBatching(cfg.sft.micro_batch_size) if sft else MicroBatching.of(cfg.actor)
    return TrainedModel(
        inputs.mesh,
        inputs.model_dir,
        dtype=cfg.model.dtype,
        optim=settings,
        micro_batching=micro_batching,
        model_options=model_options(cfg, cfg.actor),
        # The SFT warm start trains the whole model; RL then adapts what it left.
        lora=None if sft else lora_spec(cfg.actor.lora, cfg.trainer.seed),
        adapter_path=None if sft else cfg.actor.lora.adapter_path,
    )


def build_reference(inputs: RunInputs, actor: TrainedModel) -> TrainedModel | LoraReference:
    """The frozen reference policy: the actor's start weights, a model of its own; or, for a
    LoRA actor, the actor itself with its adapters switched off (the base it started from)."""
    if actor.lora is not None:
        return LoraReference(actor)
    cfg = inputs.cfg
    return TrainedModel(
        inputs.mesh,
        inputs.model_dir,
        dtype=cfg.model.dtype,
        micro_batching=MicroBatching.of(cfg.actor),
        model_options=model_options(cfg),
    )


def build_critic(inputs: RunInputs, total_steps: int) -> TrainedModel:
    """PPO's value model in the actor's layout: from ``critic.model_path`` or the actor's start
    weights (after any SFT warm start) with a fresh value head; its own optimizer, LR schedule,
    micro-batches, recomputation and offloading (``critic.*``)."""
    from parallel.convert import hf_model_dir_problem

    cfg, mesh = inputs.cfg, inputs.mesh
    c = cfg.critic
    hf_dir = c.model_path or inputs.model_dir
    if c.model_path:
        problem = hf_model_dir_problem(c.model_path)
        if problem is not None:
            raise UserError(f"critic.model_path={c.model_path}: {problem}")
    say(mesh, f"building critic (tp={mesh.tp} pp={mesh.pp} dp={mesh.dp}) from {hf_dir}")
    critic = TrainedModel(
        mesh,
        hf_dir,
        dtype=cfg.model.dtype,
        head=ValueHead(),
        optim=optimizer_settings(
            c,
            total_steps=total_steps,
            use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
        ),
        micro_batching=MicroBatching.of(c),
        model_options=model_options(cfg, c),
    )
    vocab = critic.hf_config.vocab_size
    actor_vocab = len(inputs.tokenizer)
    if c.model_path and vocab < actor_vocab:
        raise UserError(
            f"critic.model_path={c.model_path} has vocab_size {vocab}, fewer than the actor's "
            f"tokenizer ({actor_vocab} tokens): the critic reads the actor's token ids"
        )
    return critic


def needs_reference(cfg: RLConfig) -> bool:
    return cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward


def build_kl_controller(cfg: RLConfig) -> KLController:
    kl = cfg.algorithm.kl_ctrl
    return algorithms.get_kl_controller(kl.type, kl.kl_coef, kl.target_kl, kl.horizon)


def build_logger(inputs: RunInputs, total_steps: int, resumed_from: int | None) -> MetricsLogger:
    cfg = inputs.cfg
    return MetricsLogger(
        inputs.output_dir,
        backends=cfg.logging.backends,
        project=cfg.trainer.project_name,
        experiment=cfg.trainer.experiment_name,
        config_dict=to_dict(cfg),
        total_steps=total_steps,
        rank=inputs.mesh.rank,
        resumed_from_step=resumed_from,
    )
