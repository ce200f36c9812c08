"""Typed configuration: one dataclass per component, defaults in code, recipes hold what differs.

A recipe is a YAML file whose top-level keys are the sections below; command-line overrides are
OmegaConf dot-lists (``actor.lr=1e-5``). ``rlcli.config_loader.load_config`` merges defaults <-
recipe <- overrides, validates (``rlcli.config_validation``) and turns every mistake into a
:class:`~rlcli.errors.UserError` that names the key, file or line.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Literal, Optional

from omegaconf import OmegaConf


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)  # JSONL / Parquet, verl's schema
    # held-out prompts for val/reward/accuracy (same schema)
    val_files: list[str] = field(default_factory=list)
    prompt_key: str = "prompt"  # the row key holding the chat messages
    max_prompt_length: int = 256  # longer prompts are dropped (and counted)
    train_batch_size: int = 8  # prompts per step (each sampled rollout.n times)
    shuffle: bool = True  # reshuffle the training prompts every epoch
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
    # The layers: auto | transformer_engine | local (megatron-core's own torch layers). auto: TE's
    # where TE imports, else the local ones (also when model.attention_backend is sdpa or local).
    transformer_impl: str = "auto"
    # The core attention: auto (te with TE's layers, else sdpa) | te (TE's fused attention; needs
    # TE's layers) | sdpa (torch scaled_dot_product_attention in the local layers: flash /
    # memory-efficient kernels on GPUs) | local (megatron's unfused attention: it holds the
    # [b, heads, s, s] score matrix; kept for comparison).
    attention_backend: Literal["auto", "te", "sdpa", "local"] = "auto"
    spec: ModelBuildConfig = field(default_factory=ModelBuildConfig)


@dataclass
class ParallelConfig:
    tp: int = 1  # tensor parallel size
    pp: int = 1  # pipeline parallel size
    vpp: Optional[int] = None  # virtual pipeline stages per rank (interleaved schedule)
    dp: Optional[int] = None  # derived: world_size // (tp * pp); set it only to assert a value
    sequence_parallel: bool = False  # needs Transformer Engine and tp > 1
    # shard fp32 master weights + Adam state over DP (megatron-core)
    use_distributed_optimizer: bool = False
    timeout_minutes: int = 30  # process-group timeout (long rollouts, large checkpoint gathers)


@dataclass
class RolloutConfig:
    engine: str = "vllm"  # vllm | hf
    tp: int = 1  # inference tensor parallel size, independent of parallel.tp / parallel.pp
    n: int = 8  # samples per prompt
    temperature: float = 1.0  # sampling temperature (the trainer's log-probs use the same)
    top_p: float = 1.0  # nucleus sampling (1.0: off)
    top_k: int = -1  # top-k sampling (-1: off)
    max_tokens: int = 64  # max new tokens per response
    stop_token_ids: list[int] = field(default_factory=list)  # EOS is always a stop token
    max_model_len: Optional[int] = None  # default: data.max_prompt_length + rollout.max_tokens
    gpu_memory_utilization: float = 0.5  # GPU: share of memory vLLM takes for weights + KV cache
    kv_cache_gb: float = 1.0  # CPU only: resident KV cache per engine
    enforce_eager: bool = True  # GPU: no CUDA graphs (faster start, slower decoding)
    sync_bucket_mb: int = 0  # 0: parallel.reshard.AUTO_BUCKET_MB (small models: one bucket)
    sleep_level: int = 1  # GPU vLLM: 1 offloads weights to host, 2 discards them (sync on wake)
    # vLLM start weights: dummy (no checkpoint read; the trainer syncs from Megatron right after
    # the engine starts, which also proves the sync path) | auto (read model.path)
    load_format: str = "dummy"
    val_temperature: float = 0.0  # greedy validation
    val_n: int = 1  # samples per held-out prompt
    # Trainer-vs-engine agreement on the sampled tokens' log-probs (a broken weight sync shows
    # here): largest allowed MEAN |difference| per token (typically ~1e-7 in fp32 on CPU, ~0.01
    # in bf16; unsynced weights give whole nats), and what to do beyond it: warn | stop (exit 2).
    max_logprob_diff: float = 0.5
    logprob_diff_action: str = "warn"


@dataclass
class ActorConfig:
    lr: float = 1e-6  # peak learning rate
    min_lr: float = 0.0  # floor of the linear / cosine decay
    lr_warmup_steps: int = 0  # linear warmup from 0 (steps)
    lr_decay_style: str = "constant"  # constant | linear | cosine
    weight_decay: float = 0.0  # AdamW weight decay
    adam_beta1: float = 0.9  # AdamW beta1
    adam_beta2: float = 0.999  # AdamW beta2
    adam_eps: float = 1e-8  # AdamW epsilon
    grad_clip: float = 1.0  # max global grad norm (0: off)
    ppo_epochs: int = 1  # passes over each batch
    ppo_mini_batch_size: Optional[int] = None  # prompts per optimizer step; None: the whole batch
    micro_batch_size: int = 8  # sequences per forward/backward
    # Token budgets (0: fixed micro_batch_size; else at least data.max_prompt_length +
    # rollout.max_tokens): micro-batches of similar lengths whose padded size (rows x longest
    # row) stays within the budget; the no-grad passes (old log-probs, reference) use
    # max_tokens_per_forward (0: the training setting).
    max_tokens_per_micro_batch: int = 0
    max_tokens_per_forward: int = 0
    # Packed sequences: every micro-batch is ONE row of whole sequences end to end, filled up to
    # the token budget above (0: micro_batch_size x the batch's longest sequence), so no padding
    # is computed; the same for the reference and the critic (critic.micro_batch_size). Needs
    # model.attention_backend sdpa or te.
    pack_sequences: bool = False
    # old log-probs of the PPO ratio: "actor" recomputes them (skipped when the update is
    # on-policy: one epoch, one mini-batch, no KL in the reward); "engine" takes the rollout
    # engine's sampled-token log-probs (rollout/logprob_diff_* still logged)
    old_log_prob_source: str = "actor"
    policy_loss: str = "vanilla"  # see algorithms.get_policy_loss
    # token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm
    loss_agg_mode: str = "token-mean"
    clip_ratio_low: float = 0.2  # PPO clip below 1 (ratio >= 1 - low)
    clip_ratio_high: float = 0.2  # PPO clip above 1; DAPO's clip-higher: 0.28
    clip_ratio_c: float = 3.0  # dual-clip bound for negative advantages
    entropy_coeff: float = 0.0  # entropy bonus (0: entropy not computed)
    use_kl_loss: bool = False  # KL to the reference as a loss term (GRPO style)
    kl_loss_coef: float = 0.001  # weight of that KL loss
    kl_loss_type: str = "low_var_kl"  # k1 | abs | k2 | k3 / low_var_kl (+ suffix: straight-through)
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
    """The PPO value model (``algorithm.adv_estimator=gae``), trained with megatron-core on the
    actor's ranks (colocated) and the actor's TP x PP layout; Adam betas / eps, recomputation
    and offloading follow the actor's settings."""

    model_path: Optional[str] = None  # HF directory; None: the actor's start weights (new head)
    tp: Optional[int] = None  # None: parallel.tp (a different critic layout is not supported)
    pp: Optional[int] = None  # None: parallel.pp (likewise)
    lr: float = 1e-5
    min_lr: float = 0.0
    lr_warmup_steps: int = 0
    lr_decay_style: str = "constant"  # constant | linear | cosine
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    ppo_epochs: int = 1
    ppo_mini_batch_size: Optional[int] = None  # prompts per optimizer step; None: the whole batch
    micro_batch_size: int = 8  # sequences per forward/backward
    cliprange_value: float = 0.5  # value clipping around the rollout-time values
    loss_agg_mode: str = "token-mean"


@dataclass
class KLControlConfig:
    type: str = "fixed"  # fixed | adaptive
    kl_coef: float = 0.001  # (initial) KL coefficient
    target_kl: float = 0.1  # adaptive: KL the coefficient steers to
    horizon: int = 10000  # adaptive: samples over which it adapts


@dataclass
class DynamicSamplingConfig:
    enabled: bool = False  # DAPO: keep only groups whose metric varies, re-sample to fill
    metric: str = "score"  # what must vary within a group to keep it (score | acc)
    max_gen_batches: int = 4  # sampling rounds per step before training on what was kept


@dataclass
class OverlongConfig:
    enabled: bool = False  # DAPO: soft penalty inside a buffer before rollout.max_tokens
    buffer_len: int = 16  # tokens before rollout.max_tokens where the penalty starts
    penalty_factor: float = 1.0  # penalty at rollout.max_tokens


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"  # see algorithms.get_advantage_estimator
    gamma: float = 1.0  # discount (gae, reinforce_plus_plus)
    lam: float = 1.0  # GAE lambda
    norm_adv_by_std: bool = True  # False: Dr.GRPO
    epsilon: float = 1e-6  # added to the group std (grpo)
    use_kl_in_reward: bool = False  # fold KL to the reference into the token rewards (PPO style)
    kl_penalty: str = "kl"  # KL estimator for use_kl_in_reward (kl, abs, mse, low_var_kl, ...)
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    overlong: OverlongConfig = field(default_factory=OverlongConfig)


@dataclass
class RewardConfig:
    fn: Optional[str] = (
        None  # registered name, module:function or file.py:function; None: by data_source
    )
    # extra keyword arguments for the reward function
    kwargs: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 10.0  # per-call limit for user reward functions (a timeout scores 0)
    num_workers: int = 1  # worker processes for user reward functions
    # Stop the run (with the reward's own error) when more than this fraction of a step's
    # samples fail to score (raise, time out or return a non-number).
    max_failure_rate: float = 0.5


@dataclass
class SFTConfig:
    train_files: list[str] = field(default_factory=list)  # JSONL {"prompt", "response"} pairs
    steps: int = 0  # supervised warm-start steps before RL (0: none)
    lr: float = 1e-3  # warm-start learning rate
    batch_size: int = 64  # pairs per SFT step
    micro_batch_size: int = 64  # pairs per forward/backward
    lr_warmup_steps: int = 0  # warm-start warmup steps


@dataclass
class TrainerConfig:
    total_steps: Optional[int] = None  # None: total_epochs over the training data
    total_epochs: int = 1  # used when total_steps is None
    seed: int = 1  # data order, sampling and init
    val_freq: int = 10  # validate every N steps (0: never during training)
    val_before_train: bool = True  # held-out accuracy at step 0
    project_name: str = "rlcli"  # W&B project
    experiment_name: str = "default"  # names the run and its output folder
    # model, data, checkpoints, metrics.jsonl, tensorboard/
    output_dir: str = "outputs/${trainer.experiment_name}"
    resume: str = "auto"  # auto | none | path to a checkpoint directory
    # Stop (exit 2) after this many consecutive steps with a non-finite loss or gradient (each
    # one is dropped, not applied).
    max_nonfinite_steps: int = 3
    # torchrun restarts of the whole group after a rank dies (it then resumes from the newest
    # checkpoint): `rlcli train --nproc` (also --max-restarts N) and `rlcli launch slurm`
    # (also --max-restarts N). None: 0 locally, 3 on Slurm.
    max_restarts: Optional[int] = None
    critic_warmup: int = 0  # PPO: the first N steps train only the critic (no actor update)


@dataclass
class LoggingConfig:
    # console | tensorboard | jsonl | wandb
    backends: list[str] = field(default_factory=lambda: ["console", "tensorboard", "jsonl"])


@dataclass
class CheckpointConfig:
    save_freq: int = 0  # save every N steps (0: only at the end)
    keep_last: int = 2  # complete checkpoints kept (older ones pruned)
    dir: Optional[str] = None  # default: <trainer.output_dir>/checkpoints
    # false: model-only checkpoints (smaller; resume reloads master weights)
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


def to_dict(cfg: RLConfig) -> dict[str, Any]:
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore[return-value]


def to_yaml(cfg: RLConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
