"""The Bradley-Terry loss of pairwise reward-model training.

Shapes: ``chosen_scores``, ``rejected_scores``, ``margin`` and ``pair_mask`` are ``[batch]``: the
reward model's score of the preferred and of the other response of each pair.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def bradley_terry_loss(
    chosen_scores: torch.Tensor,
    rejected_scores: torch.Tensor,
    margin: torch.Tensor | None = None,
    *,
    pair_mask: torch.Tensor | None = None,
    denominator: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``sum_i mask_i * -log sigmoid(chosen_i - rejected_i - margin_i) / denominator``.

    The negative log-likelihood that the chosen response wins under the Bradley-Terry model
    ``P(chosen > rejected) = sigmoid(r_chosen - r_rejected)``; ``margin`` (Llama 2's margin
    loss) asks the chosen score to lead by at least that much. ``pair_mask`` (1 real, 0 filler)
    defaults to all ones and ``denominator`` to ``pair_mask.sum()`` (the mean over pairs); pass
    the global number of pairs to make micro-batch losses sum to the batch's mean.

    Returns ``(loss, metrics)``; metrics are detached 0-dim tensors over the masked pairs:
    ``accuracy`` (share of pairs with ``chosen > rejected``, a tie counting one half),
    ``score_margin`` (mean of ``chosen - rejected``), ``chosen_score`` and ``rejected_score``
    (means).
    """
    if chosen_scores.shape != rejected_scores.shape or chosen_scores.dim() != 1:
        raise ValueError(
            f"chosen_scores {tuple(chosen_scores.shape)} and rejected_scores "
            f"{tuple(rejected_scores.shape)} must be equal [batch] shapes"
        )
    if pair_mask is None:
        pair_mask = torch.ones_like(chosen_scores)
    pair_mask = pair_mask.to(chosen_scores.dtype)
    difference = chosen_scores - rejected_scores
    shifted = difference if margin is None else difference - margin.to(difference.dtype)
    if denominator is None:
        denominator = pair_mask.sum().clamp(min=1.0)
    loss = (-F.logsigmoid(shifted) * pair_mask).sum() / denominator
    with torch.no_grad():
        count = pair_mask.sum().clamp(min=1.0)
        wins = (difference > 0).to(difference.dtype) + 0.5 * (difference == 0).to(difference.dtype)
        metrics = {
            "accuracy": (wins * pair_mask).sum() / count,
            "score_margin": (difference * pair_mask).sum() / count,
            "chosen_score": (chosen_scores * pair_mask).sum() / count,
            "rejected_score": (rejected_scores * pair_mask).sum() / count,
        }
    return loss, metrics
