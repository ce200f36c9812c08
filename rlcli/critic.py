"""The PPO critic: a megatron-core value model (``parallel.model.build_model(critic=True)``) with
its own optimizer and LR schedule, and the step's two critic phases.

    critic = MegatronCritic(mesh, hf_dir, dtype, optim=OptimizerSettings(...))
    batch["values"] = critic.forward_values(batch, micro_batch_size)      # timing/values
    metrics = update_critic(critic, batch, cfg, mesh, fewest_groups)     # timing/update_critic

Value convention (as verl and OpenRLHF): ``values[b, j]`` is the value head's output at the
position that PREDICTS response token ``j``, i.e. on the last prompt token for ``j = 0`` and on
response token ``j - 1`` after that: the value of the state before token ``j`` is emitted.
That is the position ``response_index[b, j]`` points at, so values are picked exactly like the
log-probs. Values are response-aligned ``[B, R]`` and zero on padding.

The critic is colocated with the actor (same ranks) and, because megatron-core keeps one set of
TP / PP process groups per process, built in the actor's layout; it is cut into mini-batches of
whole groups like the actor and into micro-batches by ``parallel.micro_batches``.
"""

from __future__ import annotations

from typing import Any

import torch

import algorithms
from parallel.mesh import Mesh
from parallel.micro_batches import ROW_KEY, micro_batches
from parallel.schedule import LossFn, forward_backward
from rlcli.actor_update import reduce_step
from rlcli.batch import response_values, split_evenly
from rlcli.config import RLConfig
from rlcli.dp_stats import DataParallelStats
from rlcli.policy import MegatronPolicy, OptimizerSettings


class MegatronCritic(MegatronPolicy):
    """The value model of this rank (TP x PP shards) and its optimizer; offload / onload and
    ``train_step`` are the policy's. Initialised from an HF directory: its transformer weights,
    and a fresh value head unless the directory has one (``score.weight`` / ``score.bias``)."""

    def __init__(
        self,
        mesh: Mesh,
        hf_dir: str,
        dtype: str,
        optim: OptimizerSettings,
        model_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(mesh, hf_dir, dtype, optim=optim, model_options=model_options, critic=True)
        self.hf_dir = hf_dir

    @torch.no_grad()
    def forward_values(self, batch: dict[str, torch.Tensor], micro_batch_size: int) -> torch.Tensor:
        """Values ``[B, R]`` of the response positions (see the module docstring), float32 on
        the CPU, zero on padding; on every rank of the model-parallel group."""
        size, seq_len = batch["input_ids"].shape
        chunks = micro_batches(
            {
                "input_ids": batch["input_ids"],
                "attention_mask": batch["attention_mask"],
                ROW_KEY: torch.arange(size),
            },
            micro_batch_size,
            equal_sizes=self.mesh.pp > 1,
            pack=self.pack_sequences,
        )
        results = forward_backward(
            self.models,
            self.mesh,
            chunks,
            None,
            forward_only=True,
            pack_sequences=self.pack_sequences,
        )
        # Micro-batches are trimmed to their own longest row: put each back at its rows.
        per_position = torch.zeros((size, seq_len), dtype=torch.float32)
        for chunk, result in zip(chunks, results, strict=True):
            values = result["values"].float().cpu()
            per_position[chunk[ROW_KEY], : values.shape[1]] = values
        return response_values(per_position, batch["response_index"]) * batch["response_mask"]

    def log_probs(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise TypeError("a critic has no log-probs; use forward_values")


def make_value_loss(cfg: RLConfig, denominator: torch.Tensor) -> LossFn:
    """The per-micro-batch clipped value loss (sums over micro-batches to the mini-batch's)."""
    c = cfg.critic

    def loss_fn(outputs: dict[str, torch.Tensor], mb: dict[str, torch.Tensor]):
        mask = mb["response_mask"].to(outputs["values"].device)
        vpreds = response_values(outputs["values"], mb["response_index"])
        loss, extra = algorithms.compute_value_loss(
            vpreds=vpreds,
            returns=mb["returns"].to(vpreds.device),
            values=mb["values"].to(vpreds.device),
            response_mask=mask,
            cliprange_value=c.cliprange_value,
            loss_agg_mode=c.loss_agg_mode,
            global_denominator=denominator,
        )
        return loss, {
            "critic/vf_loss": loss.item(),
            "critic/vf_clipfrac": float(extra["vf_clipfrac"]),
            "critic/vpred_mean": algorithms.masked_mean(vpreds.detach(), mask).item(),
        }

    return loss_fn


def update_critic(
    critic: MegatronCritic,
    batch: dict[str, torch.Tensor],
    cfg: RLConfig,
    mesh: Mesh,
    fewest_groups: int,
) -> dict[str, float]:
    """``critic.ppo_epochs`` x mini-batches of whole groups, regressing the values on
    ``batch["returns"]`` with the clipped value loss around ``batch["values"]``."""
    c = cfg.critic
    configured = cfg.data.train_batch_size // (c.ppo_mini_batch_size or cfg.data.train_batch_size)
    num_mini = max(1, min(configured, fewest_groups))
    groups = batch["group_index"]
    stats = DataParallelStats(mesh)
    history: list[dict[str, float]] = []
    for _ in range(c.ppo_epochs):
        for chunk in split_evenly(torch.unique_consecutive(groups).tolist(), num_mini):
            chosen = torch.isin(groups, torch.tensor(chunk))
            mini = {k: v[chosen] for k, v in batch.items()}
            # This rank's share of the global denominator: DDP averages gradients over DP.
            denominator = algorithms.agg_loss_denominator(
                mini["response_mask"], c.loss_agg_mode, norm_length=cfg.rollout.max_tokens
            ).double()
            denominator = (stats.sum(denominator) / mesh.dp).float()
            result = critic.train_step(mini, c.micro_batch_size, make_value_loss(cfg, denominator))
            history.append(_reduce_step(result))
    out = {k: sum(h[k] for h in history) / len(history) for k in history[0]} if history else {}
    out["critic/optimizer_steps"] = float(len(history))
    return out


def _reduce_step(result: dict[str, Any]) -> dict[str, float]:
    """One optimizer step: the value loss summed over micro-batches, the ratios averaged."""
    out = reduce_step(result, prefix="critic", summed=("critic/vf_loss",))
    out["critic/skipped_steps"] = float(bool(result.get("skipped", False)))
    return out


def value_metrics(batch: dict[str, torch.Tensor], stats: DataParallelStats) -> dict[str, float]:
    """Whole-batch (DP all-reduced) statistics of the rollout-time values and the returns:
    ``critic/returns_mean``, ``critic/values_mean`` and the explained variance
    ``1 - Var(returns - values) / Var(returns)`` over the response tokens."""
    mask = batch["response_mask"].double()
    returns, values = batch["returns"].double(), batch["values"].double()
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
