"""Reward functions (verl's ``compute_score`` signature) behind a registry, and the batch scorer.

Builtins: ``gsm8k`` (``method="strict" | "flexible"``), ``math`` (boxed answers, math-verify),
``arith`` (the quickstart task) and ``default`` (chosen per row by ``data_source``).
"""

from rlcli.rewards import arith, gsm8k, math_answer  # noqa: F401  (registers the builtins)
from rlcli.rewards.default import default_compute_score, reward_fn_for_data_source
from rlcli.rewards.manager import RewardInput, RewardManager
from rlcli.rewards.registry import (
    REWARDS,
    RewardFunction,
    get_reward_fn,
    register_reward,
    resolve_reward_fn,
)

__all__ = [
    "REWARDS",
    "RewardFunction",
    "RewardInput",
    "RewardManager",
    "default_compute_score",
    "get_reward_fn",
    "register_reward",
    "resolve_reward_fn",
    "reward_fn_for_data_source",
]
