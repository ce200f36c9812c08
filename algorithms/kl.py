"""KL penalties between the policy and the reference model, KL controllers, and the two ways of
using the penalty: as a loss term (``compute_kl_loss``) or folded into the token rewards
(``apply_kl_penalty_to_rewards``).

Shapes: ``logprob`` and ``ref_logprob`` are ``[batch, response_len]`` log-probs of the sampled
tokens under the policy and the reference; the penalty is per token, same shape.

Estimators of KL(policy || ref) from samples of the policy (J. Schulman, "Approximating KL
divergence", 2020), with ``d = logprob - ref_logprob``:

- ``k1`` / ``kl``: ``d`` (unbiased, high variance, can be negative)
- ``abs``: ``|d|``
- ``k2`` / ``mse``: ``d**2 / 2`` (biased, low variance; its gradient is the right KL gradient)
- ``k3`` / ``low_var_kl``: ``exp(-d) + d - 1`` (unbiased, >= 0); ``-d`` clamped to +-20 before
  ``exp`` and the result clamped to +-10, as in verl.

A ``+`` suffix (``k1+``, ``k3+``, ``low_var_kl+``, ...) is straight-through: the VALUE of the named
estimator with the GRADIENT of ``k2``, which is the unbiased gradient of the KL when used as a loss.
"""

from __future__ import annotations

import torch

from algorithms.aggregation import agg_loss
from algorithms.utils import BatchSum, masked_mean

KL_PENALTY_KINDS = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")


def _kl_forward(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str) -> torch.Tensor:
    if kind in ("k1", "kl"):
        return logprob - ref_logprob
    if kind == "abs":
        return (logprob - ref_logprob).abs()
    if kind in ("k2", "mse"):
        return 0.5 * (logprob - ref_logprob).square()
    if kind in ("k3", "low_var_kl"):
        log_ref_ratio = torch.clamp(ref_logprob - logprob, min=-20.0, max=20.0)
        return torch.clamp(torch.exp(log_ref_ratio) - log_ref_ratio - 1, min=-10.0, max=10.0)
    valid = ", ".join(KL_PENALTY_KINDS + tuple(k + "+" for k in KL_PENALTY_KINDS))
    raise ValueError(f"unknown KL penalty kind {kind!r}; valid kinds: {valid}")


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate ``[batch, response_len]`` of the given ``kind`` (see module docs)."""
    straight_through = kind.endswith("+")
    value = _kl_forward(logprob, ref_logprob, kind.removesuffix("+"))
    if not straight_through:
        return value
    k2 = 0.5 * (logprob - ref_logprob).square()
    return k2 - k2.detach() + value.detach()


def compute_kl_loss(
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kind: str = "low_var_kl",
    loss_agg_mode: str = "token-mean",
    global_denominator: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """KL to the reference as a loss term (GRPO style): ``agg_loss(kl_penalty(...))``, a 0-dim
    tensor. The trainer multiplies it by the KL coefficient and adds it to the policy loss."""
    per_token = kl_penalty(log_prob, ref_log_prob, kind)
    return agg_loss(per_token, response_mask, loss_agg_mode, global_denominator)


class FixedKLController:
    """Constant KL coefficient ``value``."""

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient is fixed."""


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, "Fine-Tuning LMs from Human Preferences"):
    ``value *= 1 + clip(current_kl / target_kl - 1, -0.2, 0.2) * n_steps / horizon``."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if horizon <= 0:
            raise ValueError(f"adaptive KL controller horizon must be > 0, got {horizon}")
        self.value = init_kl_coef
        self.target = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move the coefficient towards keeping ``current_kl`` at the target; ``n_steps`` is the
        number of samples the KL was measured on (verl passes the batch size)."""
        proportional_error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + proportional_error * n_steps / self.horizon


KL_CONTROLLER_KINDS = ("fixed", "adaptive")


def get_kl_controller(
    kind: str,
    kl_coef: float,
    target_kl: float | None = None,
    horizon: int | None = None,
) -> FixedKLController | AdaptiveKLController:
    """``"fixed"`` -> ``FixedKLController(kl_coef)``; ``"adaptive"`` ->
    ``AdaptiveKLController(kl_coef, target_kl, horizon)`` (both then required)."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        if target_kl is None or horizon is None:
            raise ValueError("the adaptive KL controller needs target_kl and horizon")
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(
        f"unknown KL controller kind {kind!r}; valid kinds: {', '.join(KL_CONTROLLER_KINDS)}"
    )


@torch.no_grad()
def apply_kl_penalty_to_rewards(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_ctrl: FixedKLController | AdaptiveKLController,
    kind: str = "kl",
    batch_sum: BatchSum | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL folded into the reward (PPO/RLHF style): ``scores - kl_ctrl.value * kl * mask``.

    All inputs ``[batch, response_len]``. Returns ``(token_level_rewards, metrics)`` with
    ``reward_kl_penalty`` (per-sequence mean KL averaged over the batch) and
    ``reward_kl_penalty_coeff`` (the coefficient used). Then updates ``kl_ctrl`` with that KL and
    ``n_steps = batch`` (as verl does), so call it once per training step. With ``batch_sum``
    (this is one share of a split batch) the KL and ``n_steps`` are those of the whole batch.
    """
    mask = response_mask.to(token_level_scores.dtype)
    per_token_kl = kl_penalty(old_log_prob, ref_log_prob, kind) * mask
    beta = kl_ctrl.value
    token_level_rewards = token_level_scores - beta * per_token_kl
    per_sequence = masked_mean(per_token_kl, mask, dim=-1)
    batch = token_level_scores.shape[0]
    if batch_sum is not None:
        count = batch_sum(torch.tensor(float(batch), device=per_sequence.device))
        current_kl = (batch_sum(per_sequence.sum()) / count).item()
        batch = int(count.item())
    else:
        current_kl = per_sequence.mean().item()
    kl_ctrl.update(current_kl=current_kl, n_steps=batch)
    return token_level_rewards, {"reward_kl_penalty": current_kl, "reward_kl_penalty_coeff": beta}
