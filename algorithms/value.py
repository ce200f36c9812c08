"""Clipped value (critic) loss for PPO.

Shapes: ``vpreds``, ``returns``, ``values`` and ``response_mask`` are ``[batch, response_len]``.
"""

from __future__ import annotations

import torch

from algorithms.aggregation import agg_loss
from algorithms.utils import masked_mean


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    global_denominator: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO value loss ``0.5 * max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2)``, aggregated.

    ``vpreds``: the critic's new predictions; ``values``: its predictions at rollout time;
    ``returns``: the regression targets (e.g. from ``gae``); ``c = cliprange_value``.
    Returns ``(loss, {"vf_clipfrac": share of tokens where the clipped term is larger})``.
    """
    vpreds_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    unclipped = (vpreds - returns) ** 2
    clipped = (vpreds_clipped - returns) ** 2
    loss = 0.5 * agg_loss(
        torch.maximum(unclipped, clipped), response_mask, loss_agg_mode, global_denominator
    )
    clipfrac = masked_mean((clipped > unclipped).float(), response_mask)
    return loss, {"vf_clipfrac": clipfrac.detach()}
