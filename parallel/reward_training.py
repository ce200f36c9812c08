"""Pairwise (Bradley-Terry) training and evaluation of a reward model on Megatron.

    # TokenizedPairs: parallel.preference_pairs
    pairs = TokenizedPairs(chosen=[[ids...], ...], rejected=[[ids...], ...])
    metrics = bradley_terry_step(models, mesh, optimizer, scheduler, pairs.share(mesh),
                                 num_pairs=len(pairs), micro_batch_size=8, max_tokens=0)
    report = pairwise_accuracy(models, mesh, held_out, micro_batch_size=8)

The models are reward-model chunks from ``parallel.reward_model.load_reward_model`` (DDP-wrapped
by ``parallel.optim.wrap_for_training`` for training). A pair's two sequences (prompt + response
each, token ids of the reward model's tokenizer) always sit in the same micro-batch, chosen rows
first: ``input_ids [2k, S]`` for k pairs, scored at ``parallel.reward_model.score_positions``.
Micro-batches hold ``micro_batch_size`` pairs, or as many as fit ``max_tokens`` tokens (both
sequences counted) when it is > 0; under pipeline parallelism all have the same shape (the last
one filled with masked copies).

Gradients: ``bradley_terry_step`` steps on the gradient of the mean Bradley-Terry loss over the
``num_pairs`` pairs of the global batch (every DP rank passes its equal share).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from algorithms.reward_model import bradley_terry_loss
from parallel.convert.mapping import unwrap_chunk
from parallel.cpu_compat import device
from parallel.mesh import Mesh
from parallel.micro_batches import ROW_KEY, micro_batches
from parallel.optim import train_step
from parallel.preference_pairs import TokenizedPairs, pad_sequences
from parallel.reward_model import SCORE_INDEX_KEY, pick_scores, score_positions, score_sequences
from parallel.schedule import LossFn

PAIR_MASK_KEY = "pair_mask"
MARGIN_KEY = "margin"


def _pad_token_id(models: list[torch.nn.Module]) -> int | None:
    return unwrap_chunk(models[0]).hf_config.pad_token_id


def pair_micro_batches(
    pairs: TokenizedPairs,
    pad_token_id: int | None,
    *,
    micro_batch_size: int,
    max_tokens: int = 0,
    equal_sizes: bool = False,
) -> list[dict[str, torch.Tensor]]:
    """Micro-batches of whole pairs (module docstring): ``input_ids / attention_mask [2k, S]``
    (k chosen rows, then their k rejected rows), ``score_index [2k]``, ``pair_mask [k]`` (0 on
    the filler copies of an equal-size last micro-batch), ``margin [k]`` when the pairs have
    margins, and ``row_index [k]`` (pair numbers)."""
    width = max(max(map(len, pairs.chosen)), max(map(len, pairs.rejected)))
    chosen_ids, chosen_mask = pad_sequences(pairs.chosen, pad_token_id, width)
    rejected_ids, rejected_mask = pad_sequences(pairs.rejected, pad_token_id, width)
    per_pair = {
        # `micro_batches` sizes, sorts and trims by these two: the longer sequence of each pair.
        "input_ids": chosen_ids,
        "attention_mask": torch.maximum(chosen_mask, rejected_mask),
        "chosen_mask": chosen_mask,
        "rejected_ids": rejected_ids,
        "rejected_mask": rejected_mask,
        ROW_KEY: torch.arange(len(pairs)),
    }
    if pairs.margins is not None:
        per_pair[MARGIN_KEY] = torch.tensor(pairs.margins, dtype=torch.float32)
    # Two sequences per pair: half the token budget in pairs.
    parts = micro_batches(per_pair, micro_batch_size, equal_sizes, max_tokens // 2)
    out = []
    remaining = len(pairs)
    for part in parts:
        k = part[ROW_KEY].shape[0]
        pair_mask = torch.zeros(k)
        pair_mask[: min(k, remaining)] = 1.0
        remaining -= k
        input_ids = torch.cat([part["input_ids"], part["rejected_ids"]])
        attention_mask = torch.cat([part["chosen_mask"], part["rejected_mask"]])
        micro_batch = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            SCORE_INDEX_KEY: score_positions(input_ids, attention_mask, pad_token_id),
            PAIR_MASK_KEY: pair_mask,
            ROW_KEY: part[ROW_KEY],
        }
        if MARGIN_KEY in part:
            micro_batch[MARGIN_KEY] = part[MARGIN_KEY]
        out.append(micro_batch)
    return out


def make_bradley_terry_loss(denominator: float) -> LossFn:
    """The per-micro-batch loss: summed Bradley-Terry NLL of its pairs / `denominator`, with
    sums (``rm/pairs``, ``rm/correct``, ``rm/score_margin_sum``) for the step's metrics."""

    def loss_fn(outputs: dict[str, torch.Tensor], micro_batch: dict[str, torch.Tensor]):
        scores = pick_scores(outputs["values"], micro_batch[SCORE_INDEX_KEY])
        pair_mask = micro_batch[PAIR_MASK_KEY]
        k = pair_mask.shape[0]
        loss, metrics = bradley_terry_loss(
            scores[:k],
            scores[k:],
            micro_batch.get(MARGIN_KEY),
            pair_mask=pair_mask,
            denominator=denominator,
        )
        pairs = pair_mask.sum()
        return loss, {
            "rm/loss": loss.detach(),
            "rm/pairs": pairs,
            "rm/correct": metrics["accuracy"] * pairs,
            "rm/score_margin_sum": metrics["score_margin"] * pairs,
        }

    return loss_fn


def _sum_over_data_parallel(values: list[float], mesh: Mesh) -> list[float]:
    totals = torch.tensor(values, dtype=torch.float64, device=device())
    if mesh.dp > 1:
        dist.all_reduce(totals, group=mesh.dp_group)
    return totals.tolist()


def bradley_terry_step(
    models: list[torch.nn.Module],
    mesh: Mesh,
    optimizer: Any,
    scheduler: Any,
    pairs: TokenizedPairs,
    *,
    num_pairs: int,
    micro_batch_size: int,
    max_tokens: int = 0,
) -> dict[str, Any]:
    """One optimizer step on this DP rank's share `pairs` of a global batch of `num_pairs`
    pairs (collective). Returns ``loss`` (the global batch's mean Bradley-Terry loss),
    ``accuracy`` (its pairwise accuracy before the step), ``score_margin`` (mean chosen -
    rejected score), ``grad_norm``, ``lr``, ``skipped`` — equal on every rank."""
    parts = pair_micro_batches(
        pairs,
        _pad_token_id(models),
        micro_batch_size=micro_batch_size,
        max_tokens=max_tokens,
        equal_sizes=mesh.pp > 1,
    )
    result = train_step(
        models, mesh, optimizer, scheduler, parts, make_bradley_terry_loss(num_pairs / mesh.dp)
    )
    keys = ("rm/loss", "rm/pairs", "rm/correct", "rm/score_margin_sum")
    local = [sum(m[key] for m in result["micro_batch_metrics"]) for key in keys]
    loss, counted, correct, margin = _sum_over_data_parallel(local, mesh)
    return {
        "loss": loss / mesh.dp,  # each rank's loss is its share's sum / (num_pairs / dp)
        "accuracy": correct / counted,
        "score_margin": margin / counted,
        "grad_norm": result["grad_norm"],
        "lr": result["lr"],
        "skipped": result["skipped"],
    }


@torch.no_grad()
def pairwise_accuracy(
    models: list[torch.nn.Module],
    mesh: Mesh,
    pairs: TokenizedPairs,
    *,
    micro_batch_size: int,
    max_tokens: int = 0,
) -> dict[str, float]:
    """Scores every pair of `pairs` (the same list on every rank; DP ranks split it) and returns
    ``accuracy`` (share with chosen > rejected, ties one half), ``score_margin``, ``loss`` (mean
    Bradley-Terry loss) and ``pairs`` (collective)."""
    if len(pairs) < mesh.dp:
        raise ValueError(f"{len(pairs)} held-out pairs cannot be split over dp={mesh.dp}")
    mine = pairs.select(range(mesh.dp_rank, len(pairs), mesh.dp))
    input_ids, attention_mask = pad_sequences(mine.chosen + mine.rejected, _pad_token_id(models))
    scores = score_sequences(
        models,
        mesh,
        input_ids,
        attention_mask,
        micro_batch_size=micro_batch_size,
        max_tokens=max_tokens,
    )
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
