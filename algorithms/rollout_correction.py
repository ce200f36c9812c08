"""Rollout correction: the engine that samples and the trainer that learns are two numerical
programs, so even a synchronous run trains on samples from a behaviour policy ``mu`` (the
engine's sampled-token log-probs) that differs from the trainer's ``pi_prox`` (its log-probs
before the update). These corrections weight (or mask) each token's loss by how far the two
disagree; they register in the off-policy registry (``algorithm.off_policy_correction``), take
the PPO ratio against ``pi_prox`` as ``decoupled_ppo`` does, and so serve stale samples of the
separate placement too. ``mismatch_sums`` / ``mismatch_metrics`` measure the disagreement.

With ``r_t = pi_prox(y_t) / mu(y_t)`` per generated token of sequence ``i``:

* ``seq_is``: ``w_i = min(prod_t r_t, C)`` for every token of the sequence (sequence-level IS);
* ``seq_is_geo``: ``w_i = min((prod_t r_t)^(1/T_i), C)`` (its geometric mean: length-neutral);
* ``token_mis``: ``w_t = r_t`` where ``low <= r_t <= high``, else 0 (masked IS per token);
* ``seq_mis``: ``w_i = g_i`` where ``low <= g_i <= high``, else 0 for the whole sequence,
  ``g_i`` the geometric mean above (masked IS per sequence).

Masked tokens keep their place in the loss's denominator: masking lowers the step's loss, it
does not re-normalise it. Formulas and references: docs/algorithms.md.
"""

from __future__ import annotations

import math

import torch

from algorithms.off_policy import CorrectionTerms, register_off_policy_correction
from algorithms.utils import masked_mean

# A sequence's summed log-ratio is clamped here before exponentiation: e^40 is finite in fp32
# and far beyond any cap, so only the metric of a wildly off sequence is affected.
_MAX_SEQUENCE_LOG_RATIO = 40.0


def _log_ratio(
    proximal_log_prob: torch.Tensor | None, behaviour_log_prob: torch.Tensor, name: str
) -> torch.Tensor:
    if proximal_log_prob is None:
        raise ValueError(f"{name} needs the proximal log-probs (the trainer's before the update)")
    return proximal_log_prob.detach().double() - behaviour_log_prob.detach().double()


def _sequence_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, mean: bool) -> torch.Tensor:
    """``[B, 1]``: the summed (or, ``mean``, averaged) log-ratio over each row's masked tokens."""
    summed = (log_ratio * mask).sum(dim=-1, keepdim=True)
    if mean:
        summed = summed / mask.sum(dim=-1, keepdim=True).clamp(min=1)
    return summed.clamp(-_MAX_SEQUENCE_LOG_RATIO, _MAX_SEQUENCE_LOG_RATIO)


def _capped_sequence_weights(
    proximal_log_prob: torch.Tensor | None,
    behaviour_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    cap: float,
    geometric: bool,
    name: str,
) -> CorrectionTerms:
    if not cap > 0:
        raise ValueError(f"the importance-weight cap must be > 0, got {cap}")
    mask = response_mask.double()
    per_sequence = _sequence_log_ratio(
        _log_ratio(proximal_log_prob, behaviour_log_prob, name), mask, geometric
    )
    weights = torch.exp(per_sequence.clamp(max=math.log(cap))).expand_as(mask)
    rows = mask.amax(dim=-1)  # sequences with at least one generated token
    metrics = {
        "is_weight_mean": masked_mean(weights, mask),
        "is_truncated_frac": masked_mean((per_sequence.squeeze(-1) > math.log(cap)).double(), rows),
    }
    return CorrectionTerms(
        proximal_log_prob, weights.to(behaviour_log_prob.dtype), _detached(metrics)
    )


@register_off_policy_correction("seq_is")
def sequence_importance_sampling(
    behaviour_log_prob: torch.Tensor,
    proximal_log_prob: torch.Tensor | None,
    response_mask: torch.Tensor,
    cap: float = 2.0,
    **kwargs,
) -> CorrectionTerms:
    """Sequence-level truncated IS: every token of a sequence weighted by
    ``min(prod_t pi_prox / mu, C)``, the unbiased weight of the whole sample (truncated)."""
    return _capped_sequence_weights(
        proximal_log_prob, behaviour_log_prob, response_mask, cap, False, "seq_is"
    )


@register_off_policy_correction("seq_is_geo")
def geometric_sequence_importance_sampling(
    behaviour_log_prob: torch.Tensor,
    proximal_log_prob: torch.Tensor | None,
    response_mask: torch.Tensor,
    cap: float = 2.0,
    **kwargs,
) -> CorrectionTerms:
    """Sequence-level IS with the geometric mean ``(prod_t pi_prox / mu)^(1/T)``, capped: the
    product's length dependence removed (long sequences are not all cut at the cap)."""
    return _capped_sequence_weights(
        proximal_log_prob, behaviour_log_prob, response_mask, cap, True, "seq_is_geo"
    )


def _masked(ratio: torch.Tensor, low: float, high: float) -> tuple[torch.Tensor, torch.Tensor]:
    if not 0 <= low < high:
        raise ValueError(f"the mask thresholds must satisfy 0 <= low < high, got [{low}, {high}]")
    kept = (ratio >= low) & (ratio <= high)
    return torch.where(kept, ratio, torch.zeros_like(ratio)), kept


@register_off_policy_correction("token_mis")
def token_masked_importance_sampling(
    behaviour_log_prob: torch.Tensor,
    proximal_log_prob: torch.Tensor | None,
    response_mask: torch.Tensor,
    mask_low: float = 0.5,
    mask_high: float = 2.0,
    **kwargs,
) -> CorrectionTerms:
    """Masked IS per token: ``w_t = pi_prox / mu`` inside ``[low, high]``; a token outside gets
    no loss (and so no gradient) instead of a truncated weight."""
    mask = response_mask.double()
    log_ratio = _log_ratio(proximal_log_prob, behaviour_log_prob, "token_mis")
    ratio = torch.exp(log_ratio.clamp(max=_MAX_SEQUENCE_LOG_RATIO))
    weights, kept = _masked(ratio, mask_low, mask_high)
    metrics = {
        "is_weight_mean": masked_mean(weights, mask),
        "is_masked_token_frac": masked_mean((~kept).double(), mask),
    }
    return CorrectionTerms(
        proximal_log_prob, weights.to(behaviour_log_prob.dtype), _detached(metrics)
    )


@register_off_policy_correction("seq_mis")
def sequence_masked_importance_sampling(
    behaviour_log_prob: torch.Tensor,
    proximal_log_prob: torch.Tensor | None,
    response_mask: torch.Tensor,
    mask_low: float = 0.5,
    mask_high: float = 2.0,
    **kwargs,
) -> CorrectionTerms:
    """Masked IS per sequence: every token weighted by the sequence's geometric-mean ratio when
    it lies inside ``[low, high]``; the whole sequence gets no loss otherwise."""
    mask = response_mask.double()
    log_ratio = _log_ratio(proximal_log_prob, behaviour_log_prob, "seq_mis")
    geometric = torch.exp(_sequence_log_ratio(log_ratio, mask, mean=True))
    weights, kept = _masked(geometric, mask_low, mask_high)
    rows = mask.amax(dim=-1)
    metrics = {
        "is_weight_mean": masked_mean(weights.expand_as(mask), mask),
        "is_masked_token_frac": masked_mean((~kept).double().expand_as(mask), mask),
        "is_masked_seq_frac": masked_mean((~kept).double().squeeze(-1), rows),
    }
    return CorrectionTerms(
        proximal_log_prob,
        weights.expand_as(mask).to(behaviour_log_prob.dtype),
        _detached(metrics),
    )


def _detached(metrics: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: value.detach().float() for name, value in metrics.items()}


# The sums behind the mismatch metrics, in this order (add them up over micro-batches and ranks).
MISMATCH_SUMS = (
    "kl_k1",  # sum_t log mu - log pi
    "kl_k3",  # sum_t (pi/mu - 1) - log(pi/mu)
    "ratio_squared",  # sum_t (pi/mu)^2
    "tokens",
    "ppl_ratio",  # sum_i exp(mean_t log mu - log pi): the trainer's perplexity over the engine's
    "sequence_ratio_squared",  # sum_i (prod_t pi/mu)^2, the product's log clamped at +-20
    "sequences",
)


def mismatch_sums(
    trainer_log_prob: torch.Tensor, engine_log_prob: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """float64 ``[len(MISMATCH_SUMS)]`` over the masked tokens of ``[B, R]`` log-probs of the
    sampled tokens. The samples come from the engine, so these estimate KL(engine || trainer)
    and the chi-square divergence of the trainer from the engine (``mismatch_metrics``)."""
    mask = mask.double()
    log_ratio = (trainer_log_prob.detach().double() - engine_log_prob.detach().double()) * mask
    ratio = torch.exp(log_ratio.clamp(max=_MAX_SEQUENCE_LOG_RATIO))
    tokens = mask.sum(dim=-1)
    rows = tokens > 0
    summed = log_ratio.sum(dim=-1)[rows]
    mean = summed / tokens[rows]
    return torch.stack(
        [
            -log_ratio.sum(),
            ((ratio - 1 - log_ratio) * mask).sum(),
            (ratio.square() * mask).sum(),
            tokens.sum(),
            torch.exp(-mean).sum(),
            torch.exp(2 * summed.clamp(-20, 20)).sum(),
            rows.sum().double(),
        ]
    )


def mismatch_metrics(sums: torch.Tensor) -> dict[str, float]:
    """From ``mismatch_sums`` (added up): KL(engine || trainer) by the k1 and k3 estimators per
    token, the chi-square divergence per token and per sequence, and the mean per-sequence
    perplexity ratio (trainer over engine). Empty without tokens."""
    total = dict(zip(MISMATCH_SUMS, sums.tolist(), strict=True))
    if total["tokens"] <= 0 or total["sequences"] <= 0:
        return {}
    return {
        "kl_k1": total["kl_k1"] / total["tokens"],
        "kl_k3": total["kl_k3"] / total["tokens"],
        "chi2_token": total["ratio_squared"] / total["tokens"] - 1,
        "chi2_seq": total["sequence_ratio_squared"] / total["sequences"] - 1,
        "ppl_ratio": total["ppl_ratio"] / total["sequences"],
    }
