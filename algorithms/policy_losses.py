"""Policy-gradient losses behind a string registry (``get_policy_loss("vanilla")``).

Calling convention (keywords; every loss accepts and ignores extra keywords)::

    loss, metrics = policy_loss(
        old_log_prob=...,   # [batch, response_len]; log-probs of the sampled tokens, behaviour policy
        log_prob=...,       # [batch, response_len]; same tokens under the policy being trained
        advantages=...,     # [batch, response_len]
        response_mask=...,  # [batch, response_len]; 1 for response tokens, 0 for padding
        loss_agg_mode="token-mean",
        clip_ratio_low=0.2, clip_ratio_high=0.2,  # DAPO clip-higher: clip_ratio_high > low
        clip_ratio_c=3.0,   # dual-clip bound for negative advantages
        global_denominator=None,  # from agg_loss_denominator(mini-batch mask, loss_agg_mode)
        rollout_is_weights=None,  # optional [batch, response_len] per-token weights
    )

``loss`` is a 0-dim tensor to minimise. ``metrics`` holds detached 0-dim tensors (call
``.item()`` when logging; not done here to avoid a device sync per micro-batch):
``pg_clipfrac`` (fraction of tokens whose clipped term won), ``pg_clipfrac_lower`` (fraction
limited by the dual clip), ``ppo_kl`` (mean of ``old_log_prob - log_prob`` over the mask).
Definitions follow verl's ``core_algos.py``. ``global_denominator`` makes micro-batch losses sum
exactly to the mini-batch loss; see ``algorithms.aggregation``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from algorithms.aggregation import agg_loss
from algorithms.registry import Registry
from algorithms.utils import masked_mean

PolicyLoss = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]

POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")
# Decorator: make a loss selectable by name (``actor.policy_loss``).
register_policy_loss = POLICY_LOSSES.register
# The loss registered under a name; ValueError listing the valid names otherwise.
get_policy_loss = POLICY_LOSSES.lookup

# exp() of a log-ratio above 20 overflows in half precision and is meaningless anyway (verl).
LOG_RATIO_CLAMP = 20.0


def _metrics(
    clipfrac: torch.Tensor, clipfrac_lower: torch.Tensor | float, ppo_kl: torch.Tensor
) -> dict[str, torch.Tensor]:
    return {
        "pg_clipfrac": clipfrac.detach(),
        "pg_clipfrac_lower": torch.as_tensor(clipfrac_lower, device=ppo_kl.device).detach(),
        "ppo_kl": ppo_kl.detach(),
    }


def _weighted(losses: torch.Tensor, rollout_is_weights: torch.Tensor | None) -> torch.Tensor:
    return losses if rollout_is_weights is None else losses * rollout_is_weights


@register_policy_loss("vanilla")
def vanilla_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    global_denominator: float | torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017) with asymmetric clip range and dual clip.

    Per token, with ``ratio = exp(clamp(log_prob - old_log_prob, -20, 20))``:
    ``max(-A * ratio, -A * clip(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high))``; for ``A < 0``
    that is further capped at ``-A * clip_ratio_c`` (dual-clip PPO, Ye et al. 2020).
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c (dual-clip bound) must be > 1.0, got {clip_ratio_c}")
    log_ratio = torch.clamp(log_prob - old_log_prob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    ppo_losses = torch.maximum(unclipped, clipped)
    dual_clip_bound = -advantages * clip_ratio_c
    dual_clipped = torch.minimum(ppo_losses, dual_clip_bound)
    token_losses = torch.where(advantages < 0, dual_clipped, ppo_losses)

    loss = agg_loss(
        _weighted(token_losses, rollout_is_weights),
        response_mask,
        loss_agg_mode,
        global_denominator,
    )
    clipfrac = masked_mean((clipped > unclipped).float(), response_mask)
    clipfrac_lower = masked_mean(
        ((ppo_losses > dual_clip_bound) & (advantages < 0)).float(), response_mask
    )
    return loss, _metrics(clipfrac, clipfrac_lower, masked_mean(-log_ratio, response_mask))


@register_policy_loss("gspo")
def gspo_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float = 4e-4,
    global_denominator: float | torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025): PPO clipping on the sequence-level ratio
    ``s_i = exp(mean_t(log_prob - old_log_prob))`` (length-normalised), applied per token as
    ``sg[s_i] * pi / sg[pi]`` so every token gets the gradient of its own log-prob scaled by s_i.

    The paper (and verl) aggregate with ``seq-mean-token-mean``; set ``loss_agg_mode`` to that
    (the mode passed in is honoured, so the trainer's ``global_denominator`` stays consistent).
    Clip ranges are much smaller than PPO's (paper: 3e-4 / 4e-4). The log ratio is capped at 10.
    """
    mask = response_mask.to(log_prob.dtype)
    log_ratio = log_prob - old_log_prob
    seq_log_ratio = (log_ratio * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)
    token_log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(torch.clamp(token_log_ratio, max=10.0))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    token_losses = torch.maximum(unclipped, clipped)

    loss = agg_loss(
        _weighted(token_losses, rollout_is_weights),
        response_mask,
        loss_agg_mode,
        global_denominator,
    )
    clipfrac = masked_mean((clipped > unclipped).float(), response_mask)
    return loss, _metrics(clipfrac, 0.0, masked_mean(-log_ratio, response_mask))


@register_policy_loss("cispo")
def cispo_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    global_denominator: float | torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1, 2025): REINFORCE with a clipped, stop-gradient importance weight,
    ``-sg(clip(ratio, 1 - low, 1 + high)) * A * log_prob``. Unlike PPO no token loses its
    gradient to clipping; only its weight is bounded."""
    log_ratio = torch.clamp(log_prob - old_log_prob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    clipped_ratio = torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    token_losses = -clipped_ratio.detach() * advantages * log_prob

    loss = agg_loss(
        _weighted(token_losses, rollout_is_weights),
        response_mask,
        loss_agg_mode,
        global_denominator,
    )
    clipfrac = masked_mean((ratio != clipped_ratio).float(), response_mask)
    return loss, _metrics(clipfrac, 0.0, masked_mean(-log_ratio, response_mask))


def _centred_product(
    advantages: torch.Tensor, log_prob: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Per-token covariance terms ``(A - mean A) * (logp - mean logp)`` (means over the mask),
    the quantity Cui et al. 2025 ("The Entropy Mechanism of RL for Reasoning LMs") tie to
    entropy collapse. ``[batch, response_len]``, detached."""
    advantages, log_prob = advantages.detach(), log_prob.detach()
    return (advantages - masked_mean(advantages, mask)) * (log_prob - masked_mean(log_prob, mask))


@register_policy_loss("clip_cov")
def clip_cov_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_cov_ratio: float = 2e-4,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    global_denominator: float | torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    **kwargs,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clip-Cov (Cui et al. 2025): PPO clip, plus the gradient of a random ``clip_cov_ratio``
    share of tokens whose covariance term lies in ``(clip_cov_lb, clip_cov_ub)`` is cut
    (tokens already clipped by PPO are not candidates). At least one candidate token is cut.

    Token selection uses means over this (micro-)batch and ``generator`` for the random draw.
    ``pg_clipfrac`` is the fraction of tokens cut by covariance. As in verl, no log-ratio clamp.
    """
    if clip_cov_ratio <= 0:
        raise ValueError(f"clip_cov_ratio must be > 0, got {clip_cov_ratio}")
    valid = response_mask > 0
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)

    covariance = _centred_product(advantages, log_prob, response_mask)
    candidates = (covariance > clip_cov_lb) & (covariance < clip_cov_ub) & valid
    candidates &= ~(clipped > unclipped)
    candidate_positions = torch.nonzero(candidates)
    num_to_cut = max(int(clip_cov_ratio * int(valid.sum())), 1)
    order = torch.randperm(len(candidate_positions), generator=generator)
    cut = candidate_positions[order[:num_to_cut].to(candidate_positions.device)]
    keep_gradient = torch.ones_like(advantages)
    keep_gradient[cut[:, 0], cut[:, 1]] = 0

    token_losses = torch.maximum(unclipped, clipped) * keep_gradient
    loss = agg_loss(
        _weighted(token_losses, rollout_is_weights),
        response_mask,
        loss_agg_mode,
        global_denominator,
    )
    clipfrac = masked_mean((keep_gradient == 0).float(), response_mask)
    return loss, _metrics(clipfrac, 0.0, masked_mean(-log_ratio, response_mask))


@register_policy_loss("kl_cov")
def kl_cov_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    kl_cov_ratio: float = 2e-4,
    ppo_kl_coef: float = 1.0,
    global_denominator: float | torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-Cov (Cui et al. 2025): unclipped surrogate ``-A * ratio``; the ``kl_cov_ratio`` share of
    tokens with the LARGEST covariance term (at least one) also get ``ppo_kl_coef * |log ratio|``.

    Selection uses means over this (micro-)batch. As in verl: no clipping, no log-ratio clamp,
    and ``ppo_kl`` is the mean ABSOLUTE log ratio. ``pg_clipfrac`` is the share of tokens that got
    the KL term.
    """
    if kl_cov_ratio <= 0:
        raise ValueError(f"kl_cov_ratio must be > 0, got {kl_cov_ratio}")
    valid = response_mask > 0
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    surrogate = -advantages * ratio

    covariance = _centred_product(advantages, log_prob, response_mask)
    num_valid = int(valid.sum())
    penalised = torch.zeros_like(valid)
    if num_valid > 0:
        num_penalised = max(1, int(num_valid * kl_cov_ratio))
        flat_valid = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
        top = torch.topk(covariance.reshape(-1)[flat_valid], num_penalised).indices
        penalised.view(-1)[flat_valid[top]] = True
    token_losses = torch.where(penalised, surrogate + ppo_kl_coef * log_ratio.abs(), surrogate)

    loss = agg_loss(
        _weighted(token_losses, rollout_is_weights),
        response_mask,
        loss_agg_mode,
        global_denominator,
    )
    clipfrac = masked_mean(penalised.float(), response_mask)
    return loss, _metrics(clipfrac, 0.0, masked_mean(log_ratio.abs(), response_mask))
