"""The reward model's config sections: scoring in the RL step (``reward.model.*``), how model and
rule rewards combine (``reward.combine.*``), and training one (``rm.*``, ``rlcli rm``). The
generative judge's section (``reward.judge.*``) is an engine section (``EngineConfig``, as
``rollout.*``). ``rlcli.config.schema`` assembles every section into ``RLConfig``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from rlcli.config.engine import EngineConfig


@dataclass
class RewardModelConfig:
    """A reward model (an HF ``*ForSequenceClassification`` folder with one label) scoring every
    sample after the rollout, on Megatron in the actor's TP x PP layout, with its own tokenizer
    and chat template when they differ from the policy's (docs/data-and-rewards.md)."""

    path: Optional[str] = None  # HF reward-model folder; None: no reward model
    micro_batch_size: int = 8  # sequences per no-grad forward
    # > 0: micro-batches of similar lengths within this token budget (rows x longest row)
    max_tokens_per_forward: int = 0
    # each micro-batch one packed row of whole sequences up to that budget (0: micro_batch_size
    # x the longest), no padding computed; needs model.attention_backend sdpa (or te)
    pack_sequences: bool = False
    # scores -> (score - mean) / std over every score seen so far in the run (running, exact)
    normalize: bool = False
    weight: float = 1.0  # the reward model's weight in the model reward (reward.combine)
    offload: bool = False  # keep its weights in host memory outside its phase


@dataclass
class RewardCombineConfig:
    """How a sample's reward is made from the rule reward (``reward.fn``) and the model reward
    (``reward.model.weight`` x score + ``reward.judge.weight`` x judge score)."""

    # weighted_sum: rule_weight x rule + model; gate: model where rule >= gate_threshold, else
    # gate_fail_reward
    mode: Literal["weighted_sum", "gate"] = "weighted_sum"
    rule_weight: float = 1.0  # weighted_sum: the rule reward's weight (0: the model alone)
    gate_threshold: float = 0.5  # gate: the rule reward a sample needs for the model to count
    gate_fail_reward: float = 0.0  # gate: the reward of a sample below the threshold


@dataclass
class RewardModelTrainingConfig:
    """``rlcli rm``: a reward model trained on preference pairs with the Bradley-Terry loss, in
    the layout of ``parallel.*`` (the model settings are ``model.*``)."""

    # JSONL / Parquet rows {"prompt", "chosen", "rejected"[, "margin"]} (rlcli.data.preferences)
    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)  # held-out pairs: pairwise accuracy
    # "arith": write the quickstart's preference pairs (the correct answer preferred) under
    # trainer.output_dir/data and train and validate on them
    synthetic: Optional[Literal["arith"]] = None
    # HF folder to start from: a language model (its transformer, a fresh score head) or a
    # reward model (trained further); its tokenizer and chat template are the reward model's.
    # None: model.path
    init_path: Optional[str] = None
    # the trained model as an HF *ForSequenceClassification folder (replaced if it exists)
    out_dir: str = "${trainer.output_dir}/reward_model"
    # rlcli train: train the reward model (as rlcli rm does) after the SFT warm start and before
    # RL, from rm.init_path or the RL start model, unless rm.out_dir holds one already; set
    # reward.model.path to rm.out_dir
    before_rl: bool = False
    # rm.before_rl: first sample the RL start policy this many times per training and held-out
    # prompt (rollout.* sampling), grade by the rule reward and add the pairs (each prompt's
    # best-graded response over each distinct worse one) to the training / held-out pairs
    # (rlcli.train.on_policy_pairs); 0: none
    on_policy_samples: int = 0
    steps: int = 100  # optimizer steps
    batch_size: int = 32  # pairs per step, all data-parallel ranks together
    micro_batch_size: int = 16  # pairs per forward/backward
    max_tokens: int = 0  # > 0: micro-batches by this token budget (both sequences of a pair)
    max_length: int = 512  # pairs with a longer sequence (prompt + response) are dropped
    lr: float = 1e-5  # Adam learning rate (betas / eps as actor.*), constant after warmup
    lr_warmup_steps: int = 0  # linear warmup steps
    weight_decay: float = 0.0  # AdamW weight decay
    grad_clip: float = 1.0  # global gradient-norm clip (0: off)
    val_freq: int = 50  # held-out accuracy every N steps, besides before and after (0: never)
    # checkpoint every N steps into <trainer.output_dir>/rm_checkpoints (0: none); a run
    # resumes from the newest one as trainer.resume says
    save_freq: int = 0


@dataclass
class JudgeConfig(EngineConfig):
    """A generative judge (LLM-as-a-judge): a causal LM served by an engine built like the
    rollout's, asked to grade each sample with ``template``; its reply is parsed into a score
    (docs/data-and-rewards.md). Its engine sleeps outside the step's judge phase."""

    path: Optional[str] = None  # HF causal-LM folder of the judge; None: no judge
    # Python format string with {question}, {response} (required) and {reference}; None: the
    # built-in template of reward.judge.mode
    template: Optional[str] = None
    # render the prompt as a user message with the judge tokenizer's chat template; None: when
    # it has one
    apply_chat_template: Optional[bool] = None
    temperature: float = 0.0  # judge sampling temperature (0: greedy)
    max_tokens: int = 128  # max new tokens per judge reply
    mode: Literal["number", "verdict"] = "number"  # a number in [min_score, max_score] | a word
    min_score: float = 0.0  # number mode: the lowest acceptable score
    max_score: float = 10.0  # number mode: the highest acceptable score
    # number mode: regex with one group, the last match is the score; None: 'Score: N'
    pattern: Optional[str] = None
    # verdict mode: the last of these words (whole, any case) in the reply -> its score
    verdicts: dict[str, float] = field(default_factory=lambda: {"correct": 1.0, "incorrect": 0.0})
    default_score: float = 0.0  # the score of a reply without an acceptable one (counted)
    weight: float = 1.0  # the judge's weight in the model reward (reward.combine)

    # The engine settings a judge has no choice of (read by the engine like rollout's keys):
    @property
    def load_format(self) -> str:
        return "auto"  # the weights are read from reward.judge.path: nothing ever syncs them

    @property
    def sleep_level(self) -> int:
        return 1  # the weights stay in host memory (level 2 would discard what nothing reloads)
