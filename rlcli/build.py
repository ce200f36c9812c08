"""The one factory: config -> ``Trainer`` (``rlcli train``), or an SFT-only run (``rlcli sft``).

Every rank builds the same things in the same order: rewards (a reward spec that does not import
fails at once), inputs (process groups, data, model), the SFT warm start, the actor, the
reference, PPO's critic, the rollout engine, then resumes from the newest checkpoint when asked.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import algorithms
from rlcli.advantages import KLController
from rlcli.config import RLConfig, TrainedModelConfig, to_dict
from rlcli.config_validation import uses_critic
from rlcli.data import PromptLoader
from rlcli.errors import UserError
from rlcli.inputs import RunInputs, barrier, prepare_inputs
from rlcli.lora import lora_spec
from rlcli.metrics import MetricsLogger
from rlcli.rewards import RewardManager
from rlcli.rollout.base import RolloutEngine
from rlcli.run_checkpoint import CheckpointManager, checkpoint_root, resume_run
from rlcli.sampling import ReplicaInfo
from rlcli.trained_model import (
    LoraReference,
    MicroBatching,
    OptimizerSettings,
    TrainedModel,
)
from rlcli.trainer import Trainer, say


def build_trainer(cfg: RLConfig, reference: bool | None = None, logger: bool = True) -> Trainer:
    """Everything a run needs, from the config. ``reference`` forces building the reference
    model (default: only when a KL term uses it); ``logger=False`` builds no metrics logger."""
    rewards = build_rewards(cfg)
    inputs = prepare_inputs(cfg)
    if cfg.sft.steps > 0:
        inputs.model_dir = str(warm_start(inputs))
    loader = PromptLoader(
        inputs.train_data,
        cfg.data.train_batch_size,
        shuffle=cfg.data.shuffle,
        seed=cfg.trainer.seed,
    )
    total = cfg.trainer.total_steps or cfg.trainer.total_epochs * loader.batches_per_epoch
    mesh = inputs.mesh
    say(mesh, f"building actor (tp={mesh.tp} pp={mesh.pp} dp={mesh.dp}) from {inputs.model_dir}")
    actor = build_actor(inputs, total_steps=total)
    ref = None
    if needs_reference(cfg) if reference is None else reference:
        ref = build_reference(inputs, actor)
    critic = build_critic(inputs, total_steps=total) if uses_critic(cfg) else None
    say(mesh, f"starting the {cfg.rollout.engine} engine (rollout.tp={cfg.rollout.tp})")
    engine, replica = build_engine(inputs)
    from rlcli.rollout.transport import make_transport

    trainer = Trainer(
        cfg=cfg,
        mesh=mesh,
        tokenizer=inputs.tokenizer,
        model_dir=inputs.model_dir,
        actor=actor,
        reference=ref,
        engine=engine,
        transport=make_transport(cfg.rollout, engine, adapters=actor.lora is not None),
        replica=replica,
        rewards=rewards,
        loader=loader,
        val_data=inputs.val_data,
        kl_ctrl=build_kl_controller(cfg),
        checkpoints=CheckpointManager(
            checkpoint_root(cfg.checkpoint.dir, cfg.trainer.output_dir),
            keep_last=cfg.checkpoint.keep_last,
        ),
        logger=None,
        total_steps=total,
        critic=critic,
    )
    state = resume_run(
        trainer.checkpoints,
        cfg.trainer.resume,
        actor,
        cfg.checkpoint.save_optimizer,
        critic=critic,
    )
    if state is not None:
        loader.load_state_dict(state["loader"])
        trainer.kl_ctrl.value = state["kl_coef"]
        trainer.step = trainer.resumed_from = int(state["step"])
    if logger:
        restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
        # A group torchrun restarted before any checkpoint starts over: drop the dead attempt's
        # rows past step 0 so every step is logged once.
        resumed = 0 if restarted and trainer.resumed_from is None else trainer.resumed_from
        trainer.logger = build_logger(inputs, total, resumed)
    return trainer


def run_sft_only(cfg: RLConfig) -> Path:
    return warm_start(prepare_inputs(cfg), force=True)


def warm_start(inputs: RunInputs, force: bool = False) -> Path:
    """SFT into ``<output_dir>/sft_model`` unless it is already there; RL starts from it."""
    from rlcli.sft import sft_warm_start

    cfg, mesh = inputs.cfg, inputs.mesh
    out = inputs.output_dir / "sft_model"
    if (out / "config.json").exists() and not force:
        say(mesh, f"warm start: reusing {out}")
        return out
    files = list(cfg.sft.train_files) or inputs.sft_files
    say(mesh, f"warm start: {cfg.sft.steps} SFT steps on {', '.join(files)}")
    tmp = inputs.output_dir / "sft_model.tmp"
    if mesh.rank == 0 and tmp.exists():
        shutil.rmtree(tmp)
    barrier()
    sft_warm_start(
        inputs,
        lambda: build_actor(inputs, total_steps=cfg.sft.steps, sft=True),
        files,
        tmp,
        log=lambda m: say(mesh, m),
    )
    if mesh.rank == 0:
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)  # a crash mid-save leaves only sft_model.tmp, never a partial sft_model
    barrier()
    return out


def build_actor(inputs: RunInputs, total_steps: int, sft: bool = False) -> TrainedModel:
    """The policy, trainable: ``actor.*`` (the SFT warm start: its own lr, warmup and
    micro-batch size)."""
    cfg = inputs.cfg
    settings = OptimizerSettings.of(
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
        head="value",
        optim=OptimizerSettings.of(
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


def model_options(cfg: RLConfig, section: TrainedModelConfig | None = None) -> dict[str, Any]:
    """``parallel.model.build_model``'s layout options from the config; a model that trains
    adds its own activation recomputation (``section``: its ``actor`` / ``critic`` section)."""
    options: dict[str, Any] = {
        "sequence_parallel": cfg.parallel.sequence_parallel,
        "transformer_impl": cfg.model.transformer_impl,
    }
    if section is not None:
        from parallel.memory_terms import recompute_options

        options["recompute"] = recompute_options(
            section.recompute, section.recompute_method, section.recompute_num_layers
        )
    return options


def needs_reference(cfg: RLConfig) -> bool:
    return cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward


def build_kl_controller(cfg: RLConfig) -> KLController:
    kl = cfg.algorithm.kl_ctrl
    return algorithms.get_kl_controller(kl.type, kl.kl_coef, kl.target_kl, kl.horizon)


def build_engine(inputs: RunInputs) -> tuple[RolloutEngine, ReplicaInfo]:
    from rlcli.rollout.base import rollout_replicas
    from rlcli.rollout.factory import make_engine

    cfg, mesh = inputs.cfg, inputs.mesh
    r = cfg.rollout
    index, count = rollout_replicas(mesh.world_size, mesh.rank, r.tp)
    adapters = cfg.actor.lora.enable and r.lora_sync == "adapter"
    engine = make_engine(
        r,
        inputs.model_dir,
        dtype=cfg.model.dtype,
        seed=cfg.trainer.seed,  # engines space request seeds per replica themselves
        max_model_len=r.max_model_len or (cfg.data.max_prompt_length + r.max_tokens),
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
