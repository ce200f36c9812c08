"""Everything a run needs, built once from the config on every rank (same order everywhere)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from parallel.mesh import Mesh, init_parallel
from rlcli.config import RLConfig, to_dict
from rlcli.config_validation import validate
from rlcli.errors import UserError
from rlcli.generation import ReplicaInfo
from rlcli.policy import MegatronPolicy, OptimizerSettings


@dataclass
class Components:
    cfg: RLConfig
    mesh: Mesh
    output_dir: Path
    model_dir: str
    tokenizer: Any
    train_data: Any
    val_data: Any
    sft_files: list[str]


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def prepare_inputs(cfg: RLConfig) -> Components:
    """Start the process groups, write synthetic data / build the model when asked, load data."""
    from transformers import AutoTokenizer

    from rlcli.data import load_prompt_dataset

    mesh = init_parallel(cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.vpp, seed=cfg.trainer.seed)
    validate(cfg, world_size=mesh.world_size)
    output_dir = Path(cfg.trainer.output_dir)
    sft_files: list[str] = []
    if cfg.data.synthetic == "arith":
        from rlcli.data import write_arith_dataset

        data_dir = output_dir / "data"
        if mesh.rank == 0 and not (data_dir / "val.jsonl").exists():
            write_arith_dataset(str(data_dir))
        barrier()
        cfg.data.train_files = cfg.data.train_files or [str(data_dir / "train.jsonl")]
        cfg.data.val_files = cfg.data.val_files or [str(data_dir / "val.jsonl")]
        sft_files = [str(data_dir / "sft_train.jsonl")]
    model_dir = cfg.model.path
    if cfg.model.build and not Path(model_dir, "config.json").exists():
        if mesh.rank == 0:
            _build_model(cfg, model_dir, sft_files)
        barrier()
    if not Path(model_dir, "config.json").is_file():
        raise UserError(
            f"model.path={model_dir!r} is not a HuggingFace model directory (no config.json)"
        )
    if not cfg.data.train_files:
        raise UserError("data.train_files is empty: give JSONL/Parquet prompt files")
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or model_dir)
    kwargs = dict(
        tokenizer=tokenizer,
        prompt_key=cfg.data.prompt_key,
        max_prompt_length=cfg.data.max_prompt_length,
        apply_chat_template=cfg.data.apply_chat_template,
    )
    train = load_prompt_dataset(cfg.data.train_files, **kwargs)
    val = load_prompt_dataset(cfg.data.val_files, **kwargs) if cfg.data.val_files else None
    return Components(cfg, mesh, output_dir, model_dir, tokenizer, train, val, sft_files)


def _build_model(cfg: RLConfig, model_dir: str, sft_files: list[str]) -> None:
    from rlcli.data import read_sft_pairs
    from rlcli.model_builder import build_model_dir

    corpus = [p + r for f in sft_files for p, r in read_sft_pairs(f)]
    if not corpus:
        raise UserError("model.build needs text to train its tokenizer: use data.synthetic=arith")
    build_model_dir(cfg.model.spec, model_dir, corpus, seed=cfg.trainer.seed)


def build_actor(c: Components, total_steps: int, sft: bool = False) -> MegatronPolicy:
    actor = c.cfg.actor
    settings = OptimizerSettings(
        lr=c.cfg.sft.lr if sft else actor.lr,
        min_lr=actor.min_lr,
        weight_decay=actor.weight_decay,
        adam_beta1=actor.adam_beta1,
        adam_beta2=actor.adam_beta2,
        adam_eps=actor.adam_eps,
        clip_grad=actor.grad_clip,
        warmup_steps=c.cfg.sft.lr_warmup_steps if sft else actor.lr_warmup_steps,
        total_steps=total_steps,
        decay_style=actor.lr_decay_style,
        use_distributed_optimizer=c.cfg.parallel.use_distributed_optimizer,
    )
    return MegatronPolicy(c.mesh, c.model_dir, c.cfg.model.dtype, optim=settings)


def needs_reference(cfg: RLConfig) -> bool:
    return cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward


def build_engine(c: Components):
    from rlcli.rollout.base import rollout_replicas
    from rlcli.rollout.factory import make_engine

    r = c.cfg.rollout
    index, count = rollout_replicas(c.mesh.world_size, c.mesh.rank, r.tp)
    engine = make_engine(
        r.engine,
        c.model_dir,
        tp=r.tp,
        dtype=c.cfg.model.dtype,
        seed=c.cfg.trainer.seed,  # engines space request seeds per replica themselves
        gpu_memory_utilization=r.gpu_memory_utilization,
        kv_cache_gb=r.kv_cache_gb,
        enforce_eager=r.enforce_eager,
        max_model_len=r.max_model_len or (c.cfg.data.max_prompt_length + r.max_tokens),
    )
    replica = ReplicaInfo(index=index, count=count, is_leader=c.mesh.rank % r.tp == 0)
    return engine, replica


def build_rewards(cfg: RLConfig):
    from rlcli.rewards import RewardManager, default_compute_score, resolve_reward_fn

    fn = (
        resolve_reward_fn(cfg.reward.fn, cfg.reward.kwargs)
        if cfg.reward.fn
        else default_compute_score
    )
    return RewardManager(fn, timeout_s=cfg.reward.timeout_s, num_workers=cfg.reward.num_workers)


def build_logger(c: Components, total_steps: int, resumed_from: int | None):
    from rlcli.metrics import MetricsLogger

    return MetricsLogger(
        c.output_dir,
        backends=c.cfg.logging.backends,
        project=c.cfg.trainer.project_name,
        experiment=c.cfg.trainer.experiment_name,
        config_dict=to_dict(c.cfg),
        total_steps=total_steps,
        rank=c.mesh.rank,
        resumed_from_step=resumed_from,
    )


def checkpoint_root(cfg: RLConfig) -> str:
    return cfg.checkpoint.dir or os.path.join(cfg.trainer.output_dir, "checkpoints")
