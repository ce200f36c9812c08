"""Model-based rewards in the RL step: a reward model on Megatron (``reward.model.*``) and a
generative judge on an engine (``reward.judge.*``) score every sample after the rollout, each in
its own phase, and their scores are combined with the rule reward (``reward.combine.*``).

    rewards = build_model_rewards(cfg, mesh, policy_tokenizer)   # None without either
    metrics = rewards.score(samples, phases, step)      # every rank, every sample, in place

Where this sits in the step: the rollout phase scores rule rewards inside ``Sampler.collect``
while the engine is awake; the reward model needs Megatron on every rank and the judge its own
engine, so both run after the rollout, when the policy's engine sleeps (on GPU its KV cache
would otherwise sit beside the reward model's forward). DAPO's group filter sees the reward the
policy is trained on: it is the step's phase after these (``rlcli.rollout.dynamic_sampling``); its
re-sampling rounds (``max_gen_batches`` > 1) would need the model reward inside the rollout and
are refused (``rlcli.validation.rewards``).

A sample's ``score`` becomes the combined reward; the rule's score stays in ``reward/
rule_score_mean`` and the rule's ``acc`` in ``reward/accuracy`` (held-out accuracy is graded by
the rule alone).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from algorithms.reward_shaping import RunningMeanStd, combine_rewards
from rlcli.errors import UserError
from rlcli.reward_models.reward_model import RewardModelInputs, reward_model_scores
from rlcli.rollout.batch import Sample

if TYPE_CHECKING:
    from parallel.mesh import Mesh
    from parallel.model_options import ModelBuildOptions
    from rlcli.config.schema import RLConfig
    from rlcli.model.residency import StepPhases
    from rlcli.model.trained_model import TrainedModel
    from rlcli.reward_models.judge_scoring import Judge


@dataclass
class ModelRewards:
    """The step's model rewards: the frozen reward model (+ how samples become its inputs, and
    the running normaliser of its scores) and / or the judge, and how they combine."""

    cfg: RLConfig
    reward_model: TrainedModel | None = None
    inputs: RewardModelInputs | None = None
    normalizer: RunningMeanStd | None = None  # reward.model.normalize
    judge: Judge | None = None
    policy_tokenizer: Any = None

    def score(self, samples: list[Sample], phases: StepPhases, step: int) -> dict[str, float]:
        """Score every sample (phases ``reward_model`` and ``judge``) and set each one's
        ``score`` to its combined reward. Collective; every rank returns the same metrics."""
        cfg, metrics = self.cfg, {}
        rule = torch.tensor([s.score for s in samples], dtype=torch.float64)
        model = torch.zeros_like(rule)
        if self.reward_model is not None:
            with phases("reward_model"):
                scores = reward_model_scores(self.reward_model, self.inputs, samples).double()
                metrics.update(spread("reward/model_score", scores))
                if self.normalizer is not None:
                    self.normalizer.update(scores)  # the global batch's: alike on every rank
                    scores = self.normalizer.normalize(scores)
                    metrics["reward/model_score_running_mean"] = self.normalizer.mean
                    metrics["reward/model_score_running_std"] = self.normalizer.std
                model += cfg.reward.model.weight * scores
        if self.judge is not None:
            with phases("judge"):
                seed = cfg.trainer.seed * 100_003 + step * 7_919 + 1
                judged = self.judge.score(samples, self.policy_tokenizer, seed)
            scores = torch.tensor(judged.scores, dtype=torch.float64)
            metrics.update(spread("reward/judge_score", scores))
            metrics["reward/judge_failures"] = float(judged.failures)
            metrics["reward/judge_failure_rate"] = judged.failures / max(len(samples), 1)
            model += cfg.reward.judge.weight * scores
        c = cfg.reward.combine
        rewards = combine_rewards(
            rule,
            model,
            c.mode,
            rule_weight=c.rule_weight,
            gate_threshold=c.gate_threshold,
            gate_fail_reward=c.gate_fail_reward,
        )
        for sample, reward in zip(samples, rewards.tolist(), strict=True):
            sample.score = reward
        metrics["reward/rule_score_mean"] = rule.mean().item()
        metrics.update(spread("reward/score", rewards, ("mean", "std")))
        return metrics

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: the running normaliser's statistics."""
        return {} if self.normalizer is None else {"normalizer": self.normalizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.normalizer is not None and "normalizer" in state:
            self.normalizer.load_state_dict(state["normalizer"])

    def close(self) -> None:
        if self.judge is not None:
            self.judge.engine.close()


def spread(
    prefix: str, values: torch.Tensor, stats: tuple[str, ...] = ("mean", "std", "min", "max")
) -> dict[str, float]:
    """``{prefix}_mean`` ... of a ``[N]`` tensor (std 0 for one value)."""
    out = {
        "mean": values.mean().item(),
        "std": values.std().item() if values.numel() > 1 else 0.0,
        "min": values.min().item(),
        "max": values.max().item(),
    }
    return {f"{prefix}_{name}": out[name] for name in stats}


def build_model_rewards(
    cfg: RLConfig, mesh: Mesh, policy_tokenizer: Any, model_options: ModelBuildOptions
) -> ModelRewards | None:
    """The configured model rewards, in the trainer's layout (every rank builds the same), or
    None when neither ``reward.model.path`` nor ``reward.judge.path`` is set. ``model_options``
    are the actor's ``parallel.model.build_model`` layout options."""
    if not cfg.reward.uses_model_reward:
        return None
    rewards = ModelRewards(cfg, policy_tokenizer=policy_tokenizer)
    if cfg.reward.model.path:
        rewards.reward_model, rewards.inputs = build_reward_model(
            cfg, mesh, policy_tokenizer, model_options
        )
        if cfg.reward.model.normalize:
            rewards.normalizer = RunningMeanStd()
    if cfg.reward.judge.path:
        from rlcli.reward_models.judge_scoring import build_judge

        rewards.judge = build_judge(cfg)
    return rewards


def build_reward_model(
    cfg: RLConfig, mesh: Mesh, policy_tokenizer: Any, model_options: ModelBuildOptions
) -> tuple[TrainedModel, RewardModelInputs]:
    """The frozen reward model (``reward.model.*``) in the trainer's TP x PP layout, and how a
    sample becomes its input (its own tokenizer and chat template when they differ from the
    policy's)."""
    from transformers import AutoTokenizer

    from parallel.mesh import ParallelLayoutError
    from rlcli.model.heads import ScoreHead
    from rlcli.model.trained_model import MicroBatching, TrainedModel
    from rlcli.reward_models.reward_model import check_reward_model_path

    section = cfg.reward.model
    check_reward_model_path(section.path)
    try:
        model = TrainedModel(
            mesh,
            section.path,
            micro_batching=MicroBatching(
                section.micro_batch_size, 0, section.max_tokens_per_forward, section.pack_sequences
            ),
            dtype=cfg.model.dtype,
            head=ScoreHead(),
            model_options=model_options,
        )
    except (ParallelLayoutError, ValueError) as error:  # a layout or family it cannot take
        raise UserError(f"reward.model.path={section.path}: {error}") from None
    reward_tokenizer = AutoTokenizer.from_pretrained(section.path)
    inputs = RewardModelInputs(policy_tokenizer, reward_tokenizer, cfg.data.apply_chat_template)
    return model, inputs
