"""Pure tensor RL math for rlcli: advantage estimators, policy / value / KL losses, loss
aggregation, KL controllers, DAPO helpers, the Bradley-Terry loss of reward-model training and
reward normalisation / combination. No process groups, no config objects: tensors in,
tensors out, ``[batch, response_len]`` with a ``response_mask``; algorithms are chosen by name
through ``get_advantage_estimator`` and ``get_policy_loss``.
"""

from algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    get_advantage_estimator,
    register_advantage_estimator,
)
from algorithms.aggregation import LOSS_AGG_MODES, agg_loss, agg_loss_denominator
from algorithms.dapo import filter_groups, overlong_penalty
from algorithms.kl import (
    KL_PENALTY_KINDS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty_to_rewards,
    compute_kl_loss,
    get_kl_controller,
    kl_penalty,
)
from algorithms.policy_losses import POLICY_LOSSES, get_policy_loss, register_policy_loss
from algorithms.reward_model import bradley_terry_loss
from algorithms.reward_shaping import COMBINE_MODES, RunningMeanStd, combine_rewards
from algorithms.utils import (
    group_ids_to_tensor,
    masked_mean,
    masked_sum,
    masked_whiten,
)
from algorithms.value import compute_value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "COMBINE_MODES",
    "KL_PENALTY_KINDS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "RunningMeanStd",
    "AdaptiveKLController",
    "FixedKLController",
    "agg_loss",
    "agg_loss_denominator",
    "apply_kl_penalty_to_rewards",
    "bradley_terry_loss",
    "combine_rewards",
    "compute_kl_loss",
    "compute_value_loss",
    "filter_groups",
    "get_advantage_estimator",
    "get_kl_controller",
    "get_policy_loss",
    "group_ids_to_tensor",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "overlong_penalty",
    "register_advantage_estimator",
    "register_policy_loss",
]
