"""The algorithm's config section (``algorithm.*``): the advantage estimator, KL control, DAPO's
dynamic sampling and overlong penalty, and the off-policy correction; and on-policy distillation's
(``distill.*``). ``rlcli.config.schema`` assembles every section into ``RLConfig``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from rlcli.config.engine import EngineConfig


@dataclass
class KLControlConfig:
    type: Literal["fixed", "adaptive"] = "fixed"  # the KL coefficient's controller
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
    # DAPO: soft penalty on the generated tokens inside a buffer before the response budget
    # (rollout.max_tokens; multi-turn: rollout.multi_turn.max_response_tokens)
    enabled: bool = False
    buffer_len: int = 16  # tokens before the response budget where the penalty starts
    penalty_factor: float = 1.0  # penalty at the response budget


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
    # Off-policy / rollout correction with the engine's log-probs as the behaviour policy (see
    # algorithms.get_off_policy_correction): none | decoupled_ppo | tis | seq_is | seq_is_geo |
    # token_mis | seq_mis
    off_policy_correction: str = "none"
    tis_cap: float = 2.0  # truncation of the importance weights (decoupled_ppo, tis, seq_is*)
    is_mask_low: float = 0.5  # token_mis / seq_mis: a ratio below this gets no loss
    is_mask_high: float = 2.0  # token_mis / seq_mis: a ratio above this gets no loss

    @property
    def uses_critic(self) -> bool:
        """PPO's learned value model: only the ``gae`` estimator reads values."""
        return self.adv_estimator == "gae"


@dataclass
class TeacherConfig(EngineConfig):
    """Where the teacher scores (``distill.teacher.*``): ``megatron``, a frozen Megatron model in
    the actor's layout, between the step's log-prob passes; or an inference engine of its own
    (``vllm`` / ``hf``, with its own ``tp``) scoring the sampled sequences' tokens (prompt
    log-probs) before they are shared out, asleep outside its phase."""

    engine: Literal["megatron", "vllm", "hf"] = "megatron"  # megatron | an engine of its own

    # The engine settings a teacher has no choice of (read by the engine like rollout's keys):
    @property
    def load_format(self) -> str:
        return "auto"  # the weights are read from distill.teacher_path: nothing syncs them

    @property
    def sleep_level(self) -> int:
        return 1  # the weights stay in host memory (level 2 would discard what nothing reloads)


@dataclass
class DistillConfig:
    """On-policy distillation (``distill.*``): a frozen teacher scores every token the student
    samples; the per-token reverse KL is the advantage (``algorithms.distillation``)."""

    enable: bool = False  # on-policy distillation from distill.teacher_path
    # HF causal-LM folder of the teacher; its tokenizer must be the student's (checked)
    teacher_path: Optional[str] = None
    # reverse_kl: the sampled tokens' divergence as the advantage (algorithms.get_distill_objective);
    # topk_forward_kl: a loss over the teacher's distill.top_k likeliest tokens per position
    # (algorithms.get_top_k_loss), added to the policy loss
    objective: str = "reverse_kl"
    kl_coef: float = 1.0  # weight of the divergence (in the advantage, or of the top-k loss)
    top_k: Optional[int] = None  # topk_forward_kl's teacher tokens per position (None: 16)
    # weight of the task's own advantages (algorithm.adv_estimator) mixed in; 0: pure
    # distillation, the task reward only reported
    reward_weight: float = 0.0
    offload: bool = False  # megatron teacher: its weights on the host outside its phase
    teacher: TeacherConfig = field(default_factory=TeacherConfig)

    @property
    def uses_top_k(self) -> bool:
        """The objective is a top-k loss: the teacher gives its likeliest tokens per position."""
        import algorithms

        return self.objective in algorithms.TOP_K_LOSSES

    @property
    def teacher_top_k(self) -> int:
        """How many of the teacher's likeliest tokens per position the objective reads (0: a
        sampled-token objective)."""
        if not self.uses_top_k:
            return 0
        return self.top_k if self.top_k is not None else 16
