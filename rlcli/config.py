"""Typed configuration: one dataclass per component, defaults in code, recipes hold what differs.

A recipe is a YAML file whose top-level keys are the sections below; command-line overrides are
OmegaConf dot-lists (``actor.lr=1e-5``). :func:`load_config` merges defaults <- recipe <- overrides
and turns every mistake into a :class:`~rlcli.errors.UserError` that names the key, file or line.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Optional

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from rlcli.config_validation import validate
from rlcli.errors import UserError


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)  # JSONL / Parquet, verl's schema
    val_files: list[str] = field(default_factory=list)
    prompt_key: str = "prompt"
    max_prompt_length: int = 256  # longer prompts are dropped (and counted)
    train_batch_size: int = 8  # prompts per step (each sampled rollout.n times)
    val_batch_size: Optional[int] = None  # None: the whole validation set at once
    shuffle: bool = True
    apply_chat_template: Optional[bool] = None  # None: when the tokenizer has a chat template
    synthetic: Optional[str] = None  # "arith": write the quickstart task under trainer.output_dir


@dataclass
class ModelBuildConfig:
    """A small random model built locally when ``model.build`` is true (quickstart, tests)."""

    architecture: str = "qwen2"
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 704
    vocab_size: int = 512  # of the byte-level BPE tokenizer trained on the task's text
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 512


@dataclass
class ModelConfig:
    path: str = ""  # HuggingFace model directory (safetensors + config.json + tokenizer)
    tokenizer_path: Optional[str] = None  # defaults to model.path
    dtype: str = "float32"  # float32 | bfloat16 | float16
    build: bool = False  # build model.spec locally into model.path when it does not exist yet
    # auto | transformer_engine | local. auto: TE where it imports; on CUDA without a working TE
    # startup fails unless local (memory-hungry attention) is chosen explicitly.
    transformer_impl: str = "auto"
    spec: ModelBuildConfig = field(default_factory=ModelBuildConfig)


@dataclass
class ParallelConfig:
    tp: int = 1  # tensor parallel size
    pp: int = 1  # pipeline parallel size
    vpp: Optional[int] = None  # virtual pipeline stages per rank (interleaved schedule)
    dp: Optional[int] = None  # derived: world_size // (tp * pp); set it only to assert a value
    sequence_parallel: bool = False  # needs Transformer Engine and tp > 1
    use_distributed_optimizer: bool = False
    timeout_minutes: int = 30  # process-group timeout (long rollouts, large checkpoint gathers)


@dataclass
class RolloutConfig:
    engine: str = "vllm"  # vllm | hf
    tp: int = 1  # inference tensor parallel size, independent of parallel.tp / parallel.pp
    n: int = 8  # samples per prompt
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 64  # max new tokens per response
    stop_token_ids: list[int] = field(default_factory=list)  # EOS is always a stop token
    max_model_len: Optional[int] = None  # default: data.max_prompt_length + rollout.max_tokens
    gpu_memory_utilization: float = 0.5
    kv_cache_gb: float = 1.0  # CPU only: resident KV cache per engine
    enforce_eager: bool = True
    sync_bucket_mb: int = 64
    sleep_level: int = 1  # GPU vLLM: 1 offloads weights to host, 2 discards them (sync on wake)
    # vLLM start weights: dummy (no checkpoint read; the trainer syncs from Megatron right after
    # the engine starts, which also proves the sync path) | auto (read model.path)
    load_format: str = "dummy"
    val_temperature: float = 0.0  # greedy validation
    val_n: int = 1


@dataclass
class ActorConfig:
    lr: float = 1e-6
    min_lr: float = 0.0
    lr_warmup_steps: int = 0
    lr_decay_style: str = "constant"  # constant | linear | cosine
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    ppo_epochs: int = 1
    ppo_mini_batch_size: Optional[int] = None  # prompts per optimizer step; None: the whole batch
    micro_batch_size: int = 8  # sequences per forward/backward
    policy_loss: str = "vanilla"  # see algorithms.get_policy_loss
    loss_agg_mode: str = "token-mean"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    # Memory (see `rlcli plan`): move state to pinned host memory while vLLM generates
    offload_params: bool = False  # weights: back before the log-prob forward
    offload_grads: bool = False  # gradient buffers: back (zeroed) before the update
    offload_optimizer: bool = False  # fp32 master weights + Adam moments: back before the update
    recompute: str = "none"  # activation recomputation: none | selective | full
    recompute_method: str = "uniform"  # full only: uniform | block (megatron-core's)
    recompute_num_layers: int = 1  # full only: layers per group (uniform) / per stage (block)


@dataclass
class RefConfig:
    offload: bool = False  # keep the frozen reference weights on CPU between uses


@dataclass
class CriticConfig:
    lr: float = 1e-5
    cliprange_value: float = 0.5
    micro_batch_size: int = 8
    grad_clip: float = 1.0


@dataclass
class KLControlConfig:
    type: str = "fixed"  # fixed | adaptive
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: int = 10000


@dataclass
class DynamicSamplingConfig:
    enabled: bool = False  # DAPO: keep only groups whose metric varies, re-sample to fill
    metric: str = "score"
    max_gen_batches: int = 4  # sampling rounds per step before training on what was kept


@dataclass
class OverlongConfig:
    enabled: bool = False  # DAPO: soft penalty inside a buffer before rollout.max_tokens
    buffer_len: int = 16
    penalty_factor: float = 1.0


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"  # see algorithms.get_advantage_estimator
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std: bool = True  # False: Dr.GRPO
    epsilon: float = 1e-6
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    overlong: OverlongConfig = field(default_factory=OverlongConfig)


@dataclass
class RewardConfig:
    fn: Optional[str] = (
        None  # registered name, module:function or file.py:function; None: by data_source
    )
    kwargs: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 10.0
    num_workers: int = 1


@dataclass
class SFTConfig:
    train_files: list[str] = field(default_factory=list)  # JSONL {"prompt", "response"} pairs
    steps: int = 0  # supervised warm-start steps before RL (0: none)
    lr: float = 1e-3
    batch_size: int = 64
    micro_batch_size: int = 64
    lr_warmup_steps: int = 0


@dataclass
class TrainerConfig:
    total_steps: Optional[int] = None  # None: total_epochs over the training data
    total_epochs: int = 1
    seed: int = 1
    val_freq: int = 10  # validate every N steps (0: never during training)
    val_before_train: bool = True
    project_name: str = "rlcli"
    experiment_name: str = "default"
    output_dir: str = "outputs/${trainer.experiment_name}"
    resume: str = "auto"  # auto | none | path to a checkpoint directory


@dataclass
class LoggingConfig:
    backends: list[str] = field(default_factory=lambda: ["console", "tensorboard", "jsonl"])


@dataclass
class CheckpointConfig:
    save_freq: int = 0  # save every N steps (0: only at the end)
    keep_last: int = 2
    dir: Optional[str] = None  # default: <trainer.output_dir>/checkpoints
    save_optimizer: bool = True


@dataclass
class RLConfig:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


# ---------------------------------------------------------------------------------------------
# Loading


def load_config(recipe: str | os.PathLike | None, overrides: list[str] = ()) -> RLConfig:
    """Merge defaults <- recipe YAML <- dot-list overrides, validate, and return a typed config."""
    merged = OmegaConf.structured(RLConfig)
    if recipe is not None:
        merged = _merge(merged, _read_recipe(Path(recipe)), source=str(recipe))
    if overrides:
        merged = _merge(merged, _parse_overrides(overrides), source="command line")
    try:
        OmegaConf.resolve(merged)
        cfg: RLConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as err:
        raise UserError(f"cannot resolve the config: {_omegaconf_message(err)}") from None
    validate(cfg)
    return cfg


def _read_recipe(path: Path) -> DictConfig:
    if not path.is_file():
        raise UserError(f"recipe file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err)
        raise UserError(f"invalid YAML in {path}{where}: {problem}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise UserError(f"{path}: a recipe must be a mapping of sections (data:, model:, ...)")
    return OmegaConf.create(raw)


def _parse_overrides(overrides: list[str]) -> DictConfig:
    for item in overrides:
        key = item.split("=", 1)[0]
        if "=" not in item or not key:
            raise UserError(f"override {item!r} must look like key=value (e.g. actor.lr=1e-5)")
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except OmegaConfBaseException as err:
        raise UserError(f"cannot parse overrides {list(overrides)}: {err}") from None


def _merge(base: DictConfig, update: DictConfig, source: str) -> DictConfig:
    try:
        return OmegaConf.merge(base, update)  # type: ignore[return-value]
    except ConfigKeyError as err:
        full_key = _full_key(err)
        raise UserError(f"{source}: unknown config key '{full_key}'{_suggest(full_key)}") from None
    except ValidationError as err:
        raise UserError(f"{source}: {_omegaconf_message(err)}") from None
    except OmegaConfBaseException as err:
        raise UserError(f"{source}: {_omegaconf_message(err)}") from None


def _full_key(err: OmegaConfBaseException) -> str:
    key = getattr(err, "full_key", None) or getattr(err, "key", None) or ""
    return str(key)


def _omegaconf_message(err: OmegaConfBaseException) -> str:
    msg = getattr(err, "msg", None) or str(err).splitlines()[0]
    key = _full_key(err)
    return f"{key}: {msg}" if key else msg


def valid_keys(node: type = RLConfig, prefix: str = "") -> list[str]:
    """Every dotted key the config accepts, e.g. ``actor.lr``."""
    keys = []
    for f in fields(node):
        name = f"{prefix}{f.name}"
        keys.append(name)
        default = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
        if is_dataclass(default):
            keys.extend(valid_keys(type(default), prefix=name + "."))
    return keys


def _suggest(full_key: str) -> str:
    candidates = valid_keys()
    close = difflib.get_close_matches(full_key, candidates, n=1, cutoff=0.5)
    if not close:  # a typo in the last part: compare within the same section
        section, _, leaf = full_key.rpartition(".")
        siblings = [k.rpartition(".")[2] for k in candidates if k.rpartition(".")[0] == section]
        close = [
            f"{section}.{m}" if section else m
            for m in difflib.get_close_matches(leaf, siblings, n=1)
        ]
    return f"; did you mean '{close[0]}'?" if close else ""


def to_dict(cfg: RLConfig) -> dict[str, Any]:
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore[return-value]


def to_yaml(cfg: RLConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
