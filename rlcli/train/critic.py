"""The PPO critic's math: the clipped value loss, its update and the value statistics. The model
itself is a trained-model core with a value head (``rlcli.model.trained_model.TrainedModel(...,
head=ValueHead())``, built by ``rlcli.train.build``), whose ``forward`` gives the values.

    batch.values = critic.forward(batch)                                  # timing/values
    metrics = update_critic(critic, batch, cfg, fewest_groups)            # timing/update_critic

Value convention (as verl and OpenRLHF): ``values[b, j]`` is the value head's output at the
position that PREDICTS response token ``j``, i.e. on the last prompt token for ``j = 0`` and on
response token ``j - 1`` after that: the value of the state before token ``j`` is emitted.
That is the position ``response_index[b, j]`` points at, so values are picked exactly like the
log-probs. Values are response-aligned ``[B, R]`` and zero where ``loss_mask`` is 0.

The critic is colocated with the actor (same ranks) and, because megatron-core keeps one set of
TP / PP process groups per process, built in the actor's layout; it is cut into mini-batches of
whole groups like the actor (the same loop) and into micro-batches by ``parallel.micro_batches``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

import algorithms
from parallel.step_types import LossFn, LossReport, ModelOutputs, StepResult
from rlcli.config.schema import RLConfig, mini_batch_count
from rlcli.model.dp_stats import DataParallelStats
from rlcli.model.trained_model import TrainedModel
from rlcli.rollout.batch import RolloutBatch, response_values
from rlcli.rollout.trajectory import response_limit
from rlcli.train.update_metrics import mean_over_steps, reduce_step


def make_value_loss(cfg: RLConfig, denominator: torch.Tensor) -> LossFn:
    """The per-micro-batch clipped value loss (sums over micro-batches to the mini-batch's)."""
    c = cfg.critic

    def loss_fn(outputs: ModelOutputs, mb: RolloutBatch):
        mask = mb.loss_mask.to(outputs.values.device)
        vpreds = response_values(outputs.values, mb.response_index)
        loss, extra = algorithms.compute_value_loss(
            vpreds=vpreds,
            returns=mb.require("returns").to(vpreds.device),
            values=mb.require("values").to(vpreds.device),
            response_mask=mask,
            cliprange_value=c.cliprange_value,
            loss_agg_mode=c.loss_agg_mode,
            global_denominator=denominator,
        )
        return loss, LossReport(
            {
                "critic/vf_loss": loss.item(),
                "critic/vf_clipfrac": float(extra["vf_clipfrac"]),
                "critic/vpred_mean": algorithms.masked_mean(vpreds.detach(), mask).item(),
            }
        )

    return loss_fn


def update_critic(
    critic: TrainedModel, batch: RolloutBatch, cfg: RLConfig, fewest_groups: int
) -> dict[str, float]:
    """``critic.ppo_epochs`` x mini-batches of whole groups, regressing the values on
    ``batch.returns`` with the clipped value loss around ``batch.values``."""
    c = cfg.critic
    results = critic.update(
        replace(batch, routing=None),  # the actor's experts, which R2 replays: not the critic's
        lambda mini, denominator, steps_so_far: make_value_loss(cfg, denominator),
        epochs=c.ppo_epochs,
        num_mini_batches=max(
            1,
            min(mini_batch_count(cfg.data.train_batch_size, c.ppo_mini_batch_size), fewest_groups),
        ),
        loss_agg_mode=c.loss_agg_mode,
        norm_length=response_limit(cfg),
    )
    out = mean_over_steps([_step_metrics(result) for result in results])
    out["critic/optimizer_steps"] = float(len(results))
    return out


def _step_metrics(result: StepResult) -> dict[str, float]:
    """One optimizer step: the value loss summed over micro-batches, the ratios averaged."""
    out = reduce_step(result, prefix="critic", summed=("critic/vf_loss",))
    out["critic/skipped_steps"] = float(result.skipped)
    return out


def value_metrics(batch: RolloutBatch, stats: DataParallelStats) -> dict[str, float]:
    """Whole-batch (DP all-reduced) statistics of the rollout-time values and the returns:
    ``critic/returns_mean``, ``critic/values_mean`` and the explained variance
    ``1 - Var(returns - values) / Var(returns)`` over the generated tokens."""
    mask = batch.loss_mask.double()
    returns, values = batch.require("returns").double(), batch.require("values").double()
    error = returns - values
    sums = torch.stack(
        [
            mask.sum(),
            (returns * mask).sum(),
            (returns**2 * mask).sum(),
            (error * mask).sum(),
            (error**2 * mask).sum(),
            (values * mask).sum(),
        ]
    )
    n, r, r2, e, e2, v = stats.sum(sums).tolist()
    n = max(n, 1.0)
    var_returns = r2 / n - (r / n) ** 2
    var_error = e2 / n - (e / n) ** 2
    return {
        "critic/returns_mean": r / n,
        "critic/values_mean": v / n,
        "critic/values_explained_variance": 1.0 - var_error / (var_returns + 1e-8),
    }


def value_model_config(hf_config: Any) -> Any:
    """The HF config of the critic as a one-label token-classification model (what
    ``rlcli export --critic`` writes): the architecture's ``*ForTokenClassification`` class,
    ``num_labels=1``, no classifier dropout (values are deterministic)."""
    import copy

    from transformers import AutoModelForTokenClassification

    config = copy.deepcopy(hf_config)
    model_class = AutoModelForTokenClassification._model_mapping[type(hf_config)]
    config.architectures = [model_class.__name__]
    config.num_labels = 1
    config.classifier_dropout = 0.0
    return config
