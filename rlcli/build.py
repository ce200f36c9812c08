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
from rlcli.config import RLConfig, to_dict
from rlcli.config_validation import uses_critic
from rlcli.critic import MegatronCritic
from rlcli.data import PromptLoader
from rlcli.errors import UserError
from rlcli.inputs import RunInputs, barrier, prepare_inputs
from rlcli.metrics import MetricsLogger
from rlcli.policy import MegatronPolicy, OptimizerSettings
from rlcli.rewards import RewardManager
from rlcli.rollout.base import RolloutEngine
from rlcli.run_checkpoint import CheckpointManager, checkpoint_root, resume_run
from rlcli.sampling import ReplicaInfo
from rlcli.trainer import Trainer, actor_offload, say


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
        ref = MegatronPolicy(
            mesh, inputs.model_dir, cfg.model.dtype, model_options=model_options(cfg)
        )
    critic = build_critic(inputs, total_steps=total) if uses_critic(cfg) else None
    reserve_offload_memory(cfg, mesh, actor, ref, critic)
    if ref is not None and cfg.ref.offload:
        ref.offload(params=True)
    say(mesh, f"starting the {cfg.rollout.engine} engine (rollout.tp={cfg.rollout.tp})")
    engine, replica = build_engine(inputs)
    trainer = Trainer(
        cfg=cfg,
        mesh=mesh,
        tokenizer=inputs.tokenizer,
        model_dir=inputs.model_dir,
        actor=actor,
        reference=ref,
        engine=engine,
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


def build_actor(inputs: RunInputs, total_steps: int, sft: bool = False) -> MegatronPolicy:
    cfg = inputs.cfg
    actor = cfg.actor
    settings = OptimizerSettings(
        lr=cfg.sft.lr if sft else actor.lr,
        min_lr=actor.min_lr,
        weight_decay=actor.weight_decay,
        adam_beta1=actor.adam_beta1,
        adam_beta2=actor.adam_beta2,
        adam_eps=actor.adam_eps,
        clip_grad=actor.grad_clip,
        warmup_steps=cfg.sft.lr_warmup_steps if sft else actor.lr_warmup_steps,
        total_steps=total_steps,
        decay_style=actor.lr_decay_style,
        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
    )
    return MegatronPolicy(
        inputs.mesh,
        inputs.model_dir,
        cfg.model.dtype,
        optim=settings,
        model_options=model_options(cfg, recompute=True),
    )


def build_critic(inputs: RunInputs, total_steps: int) -> MegatronCritic:
    """PPO's value model in the actor's layout: from ``critic.model_path`` or the actor's start
    weights (after any SFT warm start) with a fresh value head; its own optimizer and LR
    schedule (``critic.*``; Adam betas / eps, recomputation and offloading as the actor's)."""
    from parallel.convert import hf_model_dir_problem

    cfg, mesh = inputs.cfg, inputs.mesh
    c = cfg.critic
    for key, value, actor in (("tp", c.tp, mesh.tp), ("pp", c.pp, mesh.pp)):
        if value is not None and value != actor:  # one set of megatron groups per process
            raise UserError(
                f"critic.{key}={value} differs from the actor's {key}={actor}: the critic trains "
                f"in the actor's layout; leave critic.{key} unset"
            )
    hf_dir = c.model_path or inputs.model_dir
    if c.model_path:
        problem = hf_model_dir_problem(c.model_path)
        if problem is not None:
            raise UserError(f"critic.model_path={c.model_path}: {problem}")
    say(mesh, f"building critic (tp={mesh.tp} pp={mesh.pp} dp={mesh.dp}) from {hf_dir}")
    a = cfg.actor
    settings = OptimizerSettings(
        lr=c.lr,
        min_lr=c.min_lr,
        weight_decay=c.weight_decay,
        adam_beta1=a.adam_beta1,
        adam_beta2=a.adam_beta2,
        adam_eps=a.adam_eps,
        clip_grad=c.grad_clip,
        warmup_steps=c.lr_warmup_steps,
        total_steps=total_steps,
        decay_style=c.lr_decay_style,
        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
    )
    critic = MegatronCritic(
        mesh,
        hf_dir,
        cfg.model.dtype,
        optim=settings,
        model_options=model_options(cfg, recompute=True),
    )
    vocab = critic.hf_config.vocab_size
    actor_vocab = len(inputs.tokenizer)
    if c.model_path and vocab < actor_vocab:
        raise UserError(
            f"critic.model_path={c.model_path} has vocab_size {vocab}, fewer than the actor's "
            f"tokenizer ({actor_vocab} tokens): the critic reads the actor's token ids"
        )
    return critic


def model_options(cfg: RLConfig, recompute: bool = False) -> dict[str, Any]:
    """``parallel.model.build_model``'s layout options from the config (recomputation only
    matters for a model that trains)."""
    options: dict[str, Any] = {
        "sequence_parallel": cfg.parallel.sequence_parallel,
        "transformer_impl": cfg.model.transformer_impl,
        "attention_backend": cfg.model.attention_backend,
        "pack_sequences": cfg.actor.pack_sequences,
    }
    if recompute:
        from parallel.memory_terms import recompute_options

        a = cfg.actor
        options["recompute"] = recompute_options(
            a.recompute, a.recompute_method, a.recompute_num_layers
        )
    return options


def reserve_offload_memory(
    cfg: RLConfig,
    mesh: Any,
    actor: MegatronPolicy,
    ref: MegatronPolicy | None,
    critic: MegatronCritic | None,
) -> None:
    """Pin, now, the host buffers every configured offload copies into (``actor.offload_*``, the
    critic following them, ``ref.offload``): pinning takes seconds per 10 GB on a GPU node, so it
    is paid once here, timed, and every step's offload is only a copy."""
    planned = [(actor, actor_offload(cfg)), (critic, actor_offload(cfg))]
    planned.append((ref, {"params": cfg.ref.offload}))
    gigabytes = seconds = 0.0
    for model, kinds in planned:
        if model is not None and any(kinds.values()):
            stats = model.offloader.reserve(**kinds)
            gigabytes += stats.allocated_bytes / 1e9
            seconds += stats.allocation_seconds
    if gigabytes:
        say(
            mesh, f"offload: {gigabytes:.2f} GB of pinned host buffers allocated in {seconds:.2f} s"
        )


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
    engine = make_engine(
        r.engine,
        inputs.model_dir,
        tp=r.tp,
        dtype=cfg.model.dtype,
        seed=cfg.trainer.seed,  # engines space request seeds per replica themselves
        gpu_memory_utilization=r.gpu_memory_utilization,
        kv_cache_gb=r.kv_cache_gb,
        enforce_eager=r.enforce_eager,
        max_model_len=r.max_model_len or (cfg.data.max_prompt_length + r.max_tokens),
        sleep_level=r.sleep_level,
        load_format=r.load_format,
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
