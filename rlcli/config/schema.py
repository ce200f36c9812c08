"""Typed configuration: one dataclass per component, defaults in code, recipes hold what differs.

A recipe is a YAML file whose top-level keys are the sections below; command-line overrides are
OmegaConf dot-lists (``actor.lr=1e-5``). ``rlcli.validation.loader.load_config`` merges defaults <-
recipe <- overrides, validates (``rlcli.validation.validate``) and turns every mistake into a
:class:`~rlcli.errors.UserError` that names the key, file or line.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Literal, Optional, get_args, get_origin, get_type_hints

from omegaconf import OmegaConf

from rlcli.config.agentic import AgentOptions, MultiTurnConfig
from rlcli.config.algorithm import AlgorithmConfig, DistillConfig
from rlcli.config.engine import EngineConfig
from rlcli.config.model import ModelConfig
from rlcli.config.rewards import (
    JudgeConfig,
    RewardCombineConfig,
    RewardModelConfig,
    RewardModelTrainingConfig,
)


@dataclass
class DataConfig:
    # JSONL / Parquet files in verl's schema, or Hugging Face Hub datasets as org/name:split
    train_files: list[str] = field(default_factory=list)
    # held-out prompts for val/reward/accuracy (same schema)
    val_files: list[str] = field(default_factory=list)
    prompt_key: str = "prompt"  # the row key holding the chat messages
    max_prompt_length: int = 256  # longer prompts are dropped (and counted)
    train_batch_size: int = 8  # prompts per step (each sampled rollout.n times)
    shuffle: bool = True  # reshuffle the training prompts every epoch
    apply_chat_template: Optional[bool] = None  # None: when the tokenizer has a chat template
    # write a synthetic task under trainer.output_dir: "arith" (the quickstart),
    # "tool_multiply" (3-digit products with the calculator tool: recipes/tool_quickstart.yaml)
    # or "count_squares" (pictures drawn at run time: recipes/vlm_quickstart.yaml)
    synthetic: Optional[Literal["arith", "tool_multiply", "count_squares"]] = None
    # tool_multiply: the share of its SFT conversations that call the calculator; the others
    # answer at once (right, but a small model cannot learn to), so RL has the tool to discover
    synthetic_tool_share: float = 1.0


@dataclass
class ParallelConfig:
    tp: int = 1  # tensor parallel size
    pp: int = 1  # pipeline parallel size
    vpp: Optional[int] = None  # virtual pipeline stages per rank (interleaved schedule)
    dp: Optional[int] = None  # derived: world_size // (tp * pp); set it only to assert a value
    sequence_parallel: bool = False  # needs Transformer Engine and tp > 1
    # MoE models: expert parallel size (each rank holds 1/ep of the routed experts; must divide
    # the experts and tp * dp / expert_tp)
    ep: int = 1
    expert_tp: Optional[int] = None  # MoE models: the experts' tensor parallel size (null: tp)
    # shard fp32 master weights + Adam state over DP (megatron-core)
    use_distributed_optimizer: bool = False
    timeout_minutes: int = 30  # process-group timeout (long rollouts, large checkpoint gathers)


@dataclass
class RolloutConfig(EngineConfig):
    # colocated: every rank trains and runs an engine, in turn | separate: the last
    # rollout.num_ranks ranks only run engines, the others only train (docs/placement.md)
    placement: Literal["colocated", "separate"] = "colocated"
    num_ranks: int = 0  # separate: ranks that only run engines (a multiple of rollout.tp)
    n: int = 8  # samples per prompt
    # the engine's weights and compute; null: model.dtype. bfloat16 under an fp32 trainer samples
    # faster and is how the trainer/engine mismatch arises (docs/algorithms.md: rollout correction)
    dtype: Optional[Literal["float32", "bfloat16", "float16"]] = None
    temperature: float = 1.0  # sampling temperature (the trainer's log-probs use the same)
    top_p: float = 1.0  # nucleus sampling (1.0: off)
    top_k: int = -1  # top-k sampling (-1: off)
    max_tokens: int = 64  # max new tokens per response (multi-turn: per assistant turn)
    stop_token_ids: list[int] = field(default_factory=list)  # EOS is always a stop token
    sync_bucket_mb: int = 0  # 0: parallel.reshard.AUTO_BUCKET_MB (small models: one bucket)
    sleep_level: Literal[1, 2] = (
        1  # GPU vLLM: 1 offloads weights to host, 2 discards them (sync on wake)
    )
    # vLLM start weights: dummy (no checkpoint read; the trainer syncs from Megatron right after
    # the engine starts, which also proves the sync path) | auto (read model.path)
    load_format: Literal["dummy", "auto"] = "dummy"
    # How a LoRA actor's weights reach the engine (actor.lora.enable): merged (every sync sends
    # W + alpha/r * B A per tensor; any engine) | adapter (only the adapters move and the engine
    # applies them as a LoRA adapter; vLLM only; the base is sent when the engine has none)
    lora_sync: Literal["merged", "adapter"] = "merged"
    val_temperature: float = 0.0  # greedy validation
    val_n: int = 1  # samples per held-out prompt
    # Trainer-vs-engine agreement on the sampled tokens' log-probs (a broken weight sync shows
    # here): largest allowed MEAN |difference| per token (typically ~1e-7 in fp32 on CPU, ~0.01
    # in bf16; unsynced weights give whole nats), and what to do beyond it: warn | stop (exit 2).
    max_logprob_diff: float = 0.5  # largest allowed mean |difference| per token
    logprob_diff_action: Literal["warn", "stop"] = "warn"  # beyond it: warn | stop (exit 2)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    # An agent written against the OpenAI API, called once per sample: module:function or
    # path/file.py:function (docs/agentic.md); None: the engine answers prompts itself
    agent: Optional[str] = None
    agent_options: AgentOptions = field(default_factory=AgentOptions)

    @property
    def is_separate(self) -> bool:
        """Engines on ranks of their own (``rollout.placement=separate``)."""
        return self.placement == "separate"

    def engine_dtype(self, model_dtype: str) -> str:
        """The dtype the rollout engine runs in (``rollout.dtype``, else ``model.dtype``)."""
        return self.dtype or model_dtype


@dataclass
class TrainedModelConfig:
    """What every model trained with megatron-core (the actor, PPO's critic) is configured by:
    its Adam(W) and LR schedule, how its update is cut into mini- and micro-batches, and where its
    state lives between phases. ``actor.*`` and ``critic.*`` both have these keys."""

    lr: float = 1e-6  # peak learning rate
    min_lr: float = 0.0  # floor of the linear / cosine decay
    lr_warmup_steps: int = 0  # linear warmup from 0 (steps)
    # the LR schedule after warmup
    lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root"] = "constant"
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
    # row) stays within the budget; the no-grad passes (old log-probs, reference, values) use
    # max_tokens_per_forward (0: the training setting).
    max_tokens_per_micro_batch: int = 0  # token budget of a training micro-batch (0: rows)
    max_tokens_per_forward: int = 0  # token budget of a no-grad pass (0: the training one)
    # Packed sequences: every micro-batch is ONE row of whole sequences end to end, filled up to
    # the token budget above (0: micro_batch_size x the batch's longest sequence), so no padding
    # is computed (actor.*: also the reference's passes). Needs model.attention_backend sdpa or te.
    pack_sequences: bool = False
    loss_agg_mode: str = "token-mean"  # how per-token losses become one (algorithms.LOSS_AGG_MODES)
    # Memory (see `rlcli plan`): move state to pinned host memory while the engine generates
    offload_params: bool = False  # weights: back before the model's first forward of the step
    offload_grads: bool = False  # gradient buffers: back (zeroed) before the update
    offload_optimizer: bool = False  # fp32 master weights + Adam moments: back before the update
    recompute: Literal["none", "selective", "full"] = "none"  # activation recomputation
    recompute_method: Literal["uniform", "block"] = "uniform"  # full only (megatron-core's)
    recompute_num_layers: int = 1  # full only: layers per group (uniform) / per stage (block)


@dataclass
class LoraConfig:
    """LoRA adapters on the actor (``parallel.lora``): the base model is frozen and only the
    adapters train (no base gradients or optimizer state); the reference policy is the same
    model with its adapters switched off, so no second model is built."""

    enable: bool = False  # LoRA on the actor (false: full fine-tuning)
    rank: int = 32  # r: the adapters' inner dimension (A is [r, in], B is [out, r])
    alpha: float = 32.0  # the update is alpha / rank * B A
    dropout: float = 0.0  # on the adapters' input in training passes (off in no-grad passes)
    # Megatron linears that get adapters: linear_qkv (HF q/k/v_proj), linear_proj (o_proj),
    # linear_fc1 (gate/up_proj), linear_fc2 (down_proj); all: every one
    target_modules: list[
        Literal["all", "linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    ] = field(default_factory=lambda: ["all"])
    # a PEFT adapter folder to start from (adapter_config.json + adapter_model.safetensors; its
    # r, lora_alpha and modules must be these); None: A random, B zero (the base model)
    adapter_path: Optional[str] = None


@dataclass
class ActorConfig(TrainedModelConfig):
    """The policy: megatron-core GPT model(s) trained with the policy loss below."""

    # old log-probs of the PPO ratio: "actor" recomputes them (skipped when the update is
    # on-policy: one epoch, one mini-batch, no KL in the reward); "engine" takes the rollout
    # engine's sampled-token log-probs (rollout/logprob_diff_* still logged)
    old_log_prob_source: Literal["actor", "engine"] = "actor"
    policy_loss: str = "vanilla"  # see algorithms.get_policy_loss
    clip_ratio_low: float = 0.2  # PPO clip below 1 (ratio >= 1 - low)
    clip_ratio_high: float = 0.2  # PPO clip above 1; DAPO's clip-higher: 0.28
    clip_ratio_c: float = 3.0  # dual-clip bound for negative advantages
    entropy_coeff: float = 0.0  # entropy bonus (0: entropy not computed)
    use_kl_loss: bool = False  # KL to the reference as a loss term (GRPO style)
    kl_loss_coef: float = 0.001  # weight of that KL loss
    kl_loss_type: str = "low_var_kl"  # k1 | abs | k2 | k3 / low_var_kl (+ suffix: straight-through)
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class RefConfig:
    offload: bool = False  # keep the frozen reference weights on CPU between uses


@dataclass
class CriticConfig(TrainedModelConfig):
    """The PPO value model (``algorithm.adv_estimator=gae``), trained with megatron-core on the
    actor's ranks (colocated) in the actor's TP x PP layout (megatron-core keeps one set of
    process groups per process)."""

    model_path: Optional[str] = None  # HF directory; None: the actor's start weights (new head)
    lr: float = 1e-5  # peak learning rate
    cliprange_value: float = 0.5  # value clipping around the rollout-time values


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
    model: RewardModelConfig = field(default_factory=RewardModelConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    combine: RewardCombineConfig = field(default_factory=RewardCombineConfig)

    @property
    def uses_model_reward(self) -> bool:
        """A reward model or a generative judge scores the samples (``rlcli.reward_models.model_rewards``)."""
        return bool(self.model.path or self.judge.path)


@dataclass
class SFTConfig:
    train_files: list[str] = field(default_factory=list)  # JSONL {"prompt", "response"} pairs
    steps: int = 0  # supervised warm-start steps before RL (0: none)
    lr: float = 1e-3  # warm-start learning rate
    batch_size: int = 64  # pairs per SFT step
    micro_batch_size: int = 64  # pairs per forward/backward
    lr_warmup_steps: int = 0  # warm-start warmup steps
    # checkpoint every N steps into <trainer.output_dir>/sft_checkpoints (0: none); an interrupted
    # warm start resumes from the newest intact one unless trainer.resume=none
    save_freq: int = 0


@dataclass
class TrainerConfig:
    total_steps: Optional[int] = None  # None: total_epochs over the training data
    total_epochs: int = 1  # used when total_steps is None
    seed: int = 1  # data order, sampling and init
    # Bitwise-repeatable runs for a seed, thread count and machine: torch's deterministic
    # algorithms, cuBLAS's fixed workspaces and vLLM's batch-invariant kernels on GPUs (slower)
    deterministic: bool = False
    val_freq: int = 10  # validate every N steps (0: never during training)
    val_before_train: bool = True  # held-out accuracy at step 0
    project_name: str = "rlcli"  # W&B project
    experiment_name: str = "default"  # names the run and its output folder
    # model, data, checkpoints, metrics.jsonl, tensorboard/
    output_dir: str = "outputs/${trainer.experiment_name}"
    resume: str = "auto"  # auto (newest intact checkpoint) | none | a step_N checkpoint folder
    # Stop (exit 2) after this many consecutive steps with a non-finite loss or gradient (each
    # one is dropped, not applied).
    max_nonfinite_steps: int = 3
    # Stop (exit 2) after this many consecutive steps without an update because DAPO's filter kept
    # fewer informative groups than there are data-parallel ranks (0: never stop).
    max_skipped_steps: int = 10
    # torchrun restarts of the whole group after a rank dies (it then resumes from the newest
    # checkpoint): `rlcli train --nproc` (also --max-restarts N) and `rlcli launch slurm`
    # (also --max-restarts N). None: 0 locally, 3 on Slurm.
    max_restarts: Optional[int] = None
    critic_warmup: int = 0  # PPO: the first N steps train only the critic (no actor update)
    # rollout.placement=separate: the engines generate up to this many steps ahead of the
    # trainer, so a sample is trained on by weights at most this many versions newer than the
    # ones that generated it (0: synchronous; >= 1 needs an off-policy correction)
    max_staleness: int = 0


@dataclass
class LoggingConfig:
    # where each step's metrics go
    backends: list[Literal["console", "tensorboard", "jsonl", "wandb"]] = field(
        default_factory=lambda: ["console", "tensorboard", "jsonl"]
    )


@dataclass
class CheckpointConfig:
    save_freq: int = 0  # save every N steps (0: only at the end, and when Ctrl-C / SIGTERM stop it)
    keep_last: int = 2  # intact checkpoints kept (older ones pruned; damaged ones do not count)
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
    distill: DistillConfig = field(default_factory=DistillConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    rm: RewardModelTrainingConfig = field(default_factory=RewardModelTrainingConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    @property
    def trained_models(self) -> list[tuple[str, TrainedModelConfig]]:
        """The sections of the models this run trains, by key: the actor, and the critic when
        the algorithm has one (other runs ignore the critic section)."""
        critic = [("critic", self.critic)] if self.algorithm.uses_critic else []
        return [("actor", self.actor), *critic]

    @property
    def old_log_prob_plan(self) -> OldLogProbPlan:
        """Where the PPO ratio's old log-probs come from, decided once per run (see
        ``OldLogProbPlan``). The agreement with the engine is measured on the actor pass when
        there is one, else on the update's first forward (before any optimizer step)."""
        actor = self.actor
        if actor.old_log_prob_source == "engine":
            return "engine"
        on_policy = (
            actor.ppo_epochs == 1
            and mini_batch_count(self.data.train_batch_size, actor.ppo_mini_batch_size) == 1
            and not self.algorithm.use_kl_in_reward
            # distillation's advantage needs the student's log-probs before the update
            and not self.distill.enable
        )
        return "update_forward" if on_policy else "actor_pass"


# Where the old log-probs of the PPO ratio come from (``RLConfig.old_log_prob_plan``):
#   "actor_pass":     a separate no-grad actor forward before the update (the old_log_prob phase);
#   "update_forward": the update's own forward, detached: the update is on-policy (one epoch,
#                     one mini-batch, nothing before the update needs them), so the ratio is 1;
#   "engine":         the rollout engine's sampled-token log-probs (actor.old_log_prob_source).
OldLogProbPlan = Literal["actor_pass", "update_forward", "engine"]


def mini_batch_count(prompts: int, mini_batch_size: int | None) -> int:
    """Optimizer steps per PPO epoch: a step's ``prompts`` over ``ppo_mini_batch_size`` prompts
    each (None: the whole batch, one step). The one place it is computed."""
    return prompts // (mini_batch_size or prompts)


def choices(section: type, name: str) -> tuple[Any, ...]:
    """The values a ``Literal``-typed field of a config section accepts (declared on the field;
    for a list field, those of its items)."""
    hint = get_type_hints(section)[name]
    if get_origin(hint) is list:
        hint = get_args(hint)[0]
    return get_args(hint)


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
