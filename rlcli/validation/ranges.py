"""Values that no run can mean: a learning rate of -1 or 5, a ratio outside [0, 1], a step count
of 0. Checked first, so the message names the key that is wrong, not a later key that trips
over it (``trainer.total_steps=0`` is not ``actor.lr_warmup_steps``'s fault)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from rlcli.errors import UserError

if TYPE_CHECKING:
    from rlcli.config.schema import RLConfig

# (lowest, highest, whether each bound is allowed); None: unbounded on that side.
Bounds = tuple[float | None, float | None, bool, bool]
LEARNING_RATE: Bounds = (0.0, 1.0, False, False)
NON_NEGATIVE: Bounds = (0.0, None, True, False)
POSITIVE: Bounds = (0.0, None, False, False)
FRACTION: Bounds = (0.0, 1.0, True, True)
ADAM_BETA: Bounds = (0.0, 1.0, True, False)


def _describe(bounds: Bounds) -> str:
    low, high, low_ok, high_ok = bounds
    if high is None:
        return f"{'>=' if low_ok else '>'} {low:g}"
    return f"in {'[' if low_ok else '('}{low:g}, {high:g}{']' if high_ok else ')'}"


def _inside(value: float, bounds: Bounds) -> bool:
    low, high, low_ok, high_ok = bounds
    if not math.isfinite(value):
        return False
    above = low is None or value > low or (low_ok and value == low)
    below = high is None or value < high or (high_ok and value == high)
    return above and below


def _trained_model_ranges(key: str, section) -> list[tuple[str, float, Bounds]]:
    return [
        (f"{key}.lr", section.lr, LEARNING_RATE),
        (f"{key}.min_lr", section.min_lr, NON_NEGATIVE),
        (f"{key}.weight_decay", section.weight_decay, NON_NEGATIVE),
        (f"{key}.adam_beta1", section.adam_beta1, ADAM_BETA),
        (f"{key}.adam_beta2", section.adam_beta2, ADAM_BETA),
        (f"{key}.adam_eps", section.adam_eps, POSITIVE),
        (f"{key}.grad_clip", section.grad_clip, NON_NEGATIVE),
    ]


def check_ranges(cfg: RLConfig) -> None:
    """A UserError naming the first key whose value is out of its range, and the range."""
    total = cfg.trainer.total_steps
    if total is not None and total < 1:
        raise UserError(f"trainer.total_steps must be >= 1 (or null: epochs), got {total}")
    if cfg.trainer.total_epochs < 1:
        raise UserError(f"trainer.total_epochs must be >= 1, got {cfg.trainer.total_epochs}")
    checked = []
    for key, section in cfg.trained_models:
        checked += _trained_model_ranges(key, section)
    if cfg.sft.steps:
        checked.append(("sft.lr", cfg.sft.lr, LEARNING_RATE))
    a = cfg.actor
    checked += [
        ("actor.clip_ratio_low", a.clip_ratio_low, POSITIVE),
        ("actor.clip_ratio_high", a.clip_ratio_high, POSITIVE),
        ("actor.kl_loss_coef", a.kl_loss_coef, NON_NEGATIVE),
        ("algorithm.gamma", cfg.algorithm.gamma, FRACTION),
        ("algorithm.lam", cfg.algorithm.lam, FRACTION),
        ("rollout.gpu_memory_utilization", cfg.rollout.gpu_memory_utilization, (0, 1, False, True)),
    ]
    for key, value, bounds in checked:
        if not _inside(float(value), bounds):
            raise UserError(f"{key}={value:g} makes no sense: it must be {_describe(bounds)}")
    if cfg.actor.min_lr > cfg.actor.lr:
        raise UserError(
            f"actor.min_lr={cfg.actor.min_lr:g} is above actor.lr={cfg.actor.lr:g}: the schedule "
            "decays from lr down to min_lr"
        )
