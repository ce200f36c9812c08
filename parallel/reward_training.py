"""Pairwise (Bradley-Terry) training and evaluation of a reward model on Megatron.

    # TokenizedPairs: parallel.preference_pairs
    pairs = TokenizedPairs(chosen=[[ids...], ...], rejected=[[ids...], ...])
    metrics = bradley_terry_step(train, mesh, pairs.share(mesh), num_pairs=len(pairs),
                                 pad_token_id=0, micro_batch_size=8, max_tokens=0)
    report = pairwise_accuracy(score, mesh, held_out, pad_token_id=0)

The model is a reward model (``parallel.reward_model.load_reward_model``), reached through two
calls its owner provides: ``train(micro_batches, loss_fn) -> result``, one optimizer step as
``parallel.optim.train_step`` (``functools.partial(train_step, models, mesh, optimizer,
scheduler)`` on DDP-wrapped chunks, or rlcli's ``TrainedModel.train_micro_batches``), and
``score(input_ids, attention_mask) -> [B]`` as ``parallel.reward_model.score_sequences``. A
pair's two sequences (prompt + response each, token ids of the reward model's tokenizer) always
sit in the same micro-batch, chosen rows first: ``input_ids [2k, S]`` for k pairs, scored at ``parallel.reward_model.score_positions``.
Micro-batches hold ``micro_batch_size`` pairs, or as many as fit ``max_tokens`` tokens (both
sequences counted) when it is > 0; under pipeline parallelism all have the same shape (the last
one filled with masked copies).

Gradients: ``bradley_terry_step`` steps on the gradient of the mean Bradley-Terry loss over the
``num_pairs`` pairs of the global batch (every DP rank passes its equal share).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from algorithms.reward_model import bradley_terry_loss
from parallel.cpu_compat import device
from parallel.mesh import Mesh
from parallel.micro_batches import micro_batches
from parallel.preference_pairs import TokenizedPairs, pad_sequences
from parallel.reward_model import pick_scores, score_positions
from parallel.step_types import (
    LossFn,
    LossReport,
    MicroBatch,
    ModelOutputs,
    StepResult,
    row_field,
    sequence_field,
)


@dataclass(kw_only=True)
class PairRows(MicroBatch):
    """Pairs side by side, one row each, as ``micro_batches`` cuts them: ``input_ids`` the
    chosen sequence, ``attention_mask`` the longer of the two (what sizes, sorts and trims a
    pair), the rejected sequence and both own masks beside them."""

    chosen_mask: torch.Tensor = sequence_field()  # [k, S]
    rejected_ids: torch.Tensor = sequence_field()  # [k, S]
    rejected_mask: torch.Tensor = sequence_field()  # [k, S]
    margin: torch.Tensor | None = row_field(default=None)  # [k] float32


@dataclass(kw_only=True)
class PairMicroBatch(MicroBatch):
    """A micro-batch of k whole pairs as the model sees it: ``input_ids / attention_mask
    [2k, S]`` (k chosen rows, then their k rejected rows); ``row_index [k]`` pair numbers.
    Already cut: its row fields count pairs, not its 2k sequences."""

    score_index: torch.Tensor = row_field()  # [2k] int64, where each sequence is scored
    pair_mask: torch.Tensor = row_field()  # [k], 0 on the filler copies of an equal-size last one
    margin: torch.Tensor | None = row_field(default=None)  # [k] float32


# One optimizer step over micro-batches (see the module docstring), and scores of sequences.
TrainFn = Callable[[list[PairMicroBatch], LossFn], StepResult]
ScoreFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def pair_micro_batches(
    pairs: TokenizedPairs,
    pad_token_id: int | None,
    *,
    micro_batch_size: int,
    max_tokens: int = 0,
    equal_sizes: bool = False,
) -> list[PairMicroBatch]:
    """Micro-batches of whole pairs (module docstring, ``PairMicroBatch``); ``margin`` when the
    pairs have margins."""
    width = max(max(map(len, pairs.chosen)), max(map(len, pairs.rejected)))
    chosen_ids, chosen_mask = pad_sequences(pairs.chosen, pad_token_id, width)
    rejected_ids, rejected_mask = pad_sequences(pairs.rejected, pad_token_id, width)
    per_pair = PairRows(
        input_ids=chosen_ids,
        attention_mask=torch.maximum(chosen_mask, rejected_mask),
        chosen_mask=chosen_mask,
        rejected_ids=rejected_ids,
        rejected_mask=rejected_mask,
        row_index=torch.arange(len(pairs)),
        margin=None if pairs.margins is None else torch.tensor(pairs.margins, dtype=torch.float32),
    )
    # Two sequences per pair: half the token budget in pairs.
    parts = micro_batches(per_pair, micro_batch_size, equal_sizes, max_tokens // 2)
    out = []
    remaining = len(pairs)
    for part in parts:
        k = part.row_index.shape[0]
        pair_mask = torch.zeros(k)
        pair_mask[: min(k, remaining)] = 1.0
        remaining -= k
        input_ids = torch.cat([part.input_ids, part.rejected_ids])
        attention_mask = torch.cat([part.chosen_mask, part.rejected_mask])
        out.append(
            PairMicroBatch(
                input_ids=input_ids,
                attention_mask=attention_mask,
                score_index=score_positions(input_ids, attention_mask, pad_token_id),
                pair_mask=pair_mask,
                row_index=part.row_index,
                margin=part.margin,
            )
        )
    return out


def make_bradley_terry_loss(denominator: float) -> LossFn:
    """The per-micro-batch loss: summed Bradley-Terry NLL of its pairs / `denominator`, with
    sums (``rm/pairs``, ``rm/correct``, ``rm/score_margin_sum``) for the step's metrics."""

    def loss_fn(outputs: ModelOutputs, micro_batch: PairMicroBatch):
        scores = pick_scores(outputs.values, micro_batch.score_index)
        pair_mask = micro_batch.pair_mask
        k = pair_mask.shape[0]
        loss, metrics = bradley_terry_loss(
            scores[:k],
            scores[k:],
            micro_batch.margin,
            pair_mask=pair_mask,
            denominator=denominator,
        )
        pairs = pair_mask.sum()
        return loss, LossReport(
            {
                "rm/loss": loss.detach(),
                "rm/pairs": pairs,
                "rm/correct": metrics["accuracy"] * pairs,
                "rm/score_margin_sum": metrics["score_margin"] * pairs,
            }
        )

    return loss_fn


def _sum_over_data_parallel(values: list[float], mesh: Mesh) -> list[float]:
    totals = torch.tensor(values, dtype=torch.float64, device=device())
    if mesh.dp > 1:
        dist.all_reduce(totals, group=mesh.dp_group)
    return totals.tolist()


def bradley_terry_step(
    train: TrainFn,
    mesh: Mesh,
    pairs: TokenizedPairs,
    *,
    num_pairs: int,
    pad_token_id: int | None,
    micro_batch_size: int,
    max_tokens: int = 0,
) -> dict[str, Any]:
    """One optimizer step (``train``) on this DP rank's share `pairs` of a global batch of
    `num_pairs` pairs (collective); `pad_token_id` is the reward model's. Returns ``loss`` (the
    global batch's mean Bradley-Terry loss), ``accuracy`` (its pairwise accuracy before the
    step), ``score_margin`` (mean chosen - rejected score), ``grad_norm``, ``lr``, ``skipped``
    — equal on every rank."""
    parts = pair_micro_batches(
        pairs,
        pad_token_id,
        micro_batch_size=micro_batch_size,
        max_tokens=max_tokens,
        equal_sizes=mesh.pp > 1,
    )
    result = train(parts, make_bradley_terry_loss(num_pairs / mesh.dp))
    keys = ("rm/loss", "rm/pairs", "rm/correct", "rm/score_margin_sum")
    local = [sum(report.metrics[key] for report in result.reports) for key in keys]
    loss, counted, correct, margin = _sum_over_data_parallel(local, mesh)
    return {
        "loss": loss / mesh.dp,  # each rank's loss is its share's sum / (num_pairs / dp)
        "accuracy": correct / counted,
        "score_margin": margin / counted,
        "grad_norm": result.grad_norm,
        "lr": result.lr,
        "skipped": result.skipped,
    }


@torch.no_grad()
def pairwise_accuracy(
    score: ScoreFn, mesh: Mesh, pairs: TokenizedPairs, *, pad_token_id: int | None
) -> dict[str, float]:
    """Scores every pair of `pairs` (the same list on every rank; DP ranks split it) with
    ``score`` and returns ``accuracy`` (share with chosen > rejected, ties one half),
    ``score_margin``, ``loss`` (mean Bradley-Terry loss) and ``pairs`` (collective)."""
    if len(pairs) < mesh.dp:
        raise ValueError(f"{len(pairs)} held-out pairs cannot be split over dp={mesh.dp}")
    mine = pairs.select(range(mesh.dp_rank, len(pairs), mesh.dp))
    input_ids, attention_mask = pad_sequences(mine.chosen + mine.rejected, pad_token_id)
    scores = score(input_ids, attention_mask)
    k = len(mine)
    margins = None if mine.margins is None else torch.tensor(mine.margins, device=scores.device)
    loss, metrics = bradley_terry_loss(scores[:k], scores[k:], margins, denominator=1.0)
    local = [k, float(metrics["accuracy"]) * k, float(metrics["score_margin"]) * k, float(loss)]
    counted, correct, margin, loss_sum = _sum_over_data_parallel(local, mesh)
    return {
        "accuracy": correct / counted,
        "score_margin": margin / counted,
        "loss": loss_sum / counted,
        "pairs": int(counted),
    }
