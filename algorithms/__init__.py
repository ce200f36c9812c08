"""Pure tensor RL math for rlcli: advantage estimators, policy / value / KL losses, loss
aggregation, KL controllers, DAPO helpers, off-policy and rollout corrections (with the
trainer-vs-engine mismatch measures), on-policy distillation's per-token divergence and top-k loss, the
Bradley-Terry loss of reward-model training and reward normalisation / combination. No process groups, no config
objects: tensors in, tensors out, ``[batch, response_len]`` with a ``response_mask``;
algorithms are chosen by name through ``get_advantage_estimator``, ``get_policy_loss`` and
``get_off_policy_correction``, ``get_distill_objective``, ``get_top_k_loss`` (each a ``Registry``, ``algorithms.registry``: the one registry
helper, which ``rlcli``'s reward functions and tool-call formats use too).
"""

from algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    OUTCOME_GROUP_ESTIMATORS,
    get_advantage_estimator,
    register_advantage_estimator,
)
from algorithms.aggregation import LOSS_AGG_MODES, agg_loss, agg_loss_denominator
from algorithms.dapo import filter_groups, overlong_penalty
from algorithms.distillation import (
    DISTILL_OBJECTIVES,
    TOP_K_LOSSES,
    distill_objective_names,
    distillation_advantages,
    get_distill_objective,
    get_top_k_loss,
    k3_divergence,
    response_quarters,
)
from algorithms.kl import (
    KL_PENALTY_KINDS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty_to_rewards,
    compute_kl_loss,
    get_kl_controller,
    kl_penalty,
)
from algorithms.off_policy import (
    OFF_POLICY_CORRECTIONS,
    CorrectionTerms,
    get_off_policy_correction,
    register_off_policy_correction,
)
from algorithms.policy_losses import POLICY_LOSSES, get_policy_loss, register_policy_loss
from algorithms.registry import Registry
from algorithms.reward_model import bradley_terry_loss
from algorithms.reward_shaping import COMBINE_MODES, RunningMeanStd, combine_rewards
from algorithms.rollout_correction import MISMATCH_SUMS, mismatch_metrics, mismatch_sums
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
    "DISTILL_OBJECTIVES",
    "TOP_K_LOSSES",
    "KL_PENALTY_KINDS",
    "LOSS_AGG_MODES",
    "MISMATCH_SUMS",
    "OFF_POLICY_CORRECTIONS",
    "POLICY_LOSSES",
    "Registry",
    "RunningMeanStd",
    "AdaptiveKLController",
    "CorrectionTerms",
    "FixedKLController",
    "agg_loss",
    "agg_loss_denominator",
    "apply_kl_penalty_to_rewards",
    "bradley_terry_loss",
    "combine_rewards",
    "compute_kl_loss",
    "compute_value_loss",
    "distill_objective_names",
    "distillation_advantages",
    "filter_groups",
    "get_advantage_estimator",
    "OUTCOME_GROUP_ESTIMATORS",
    "get_distill_objective",
    "get_top_k_loss",
    "get_kl_controller",
    "get_off_policy_correction",
    "get_policy_loss",
    "group_ids_to_tensor",
    "k3_divergence",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "mismatch_metrics",
    "mismatch_sums",
    "overlong_penalty",
    "register_advantage_estimator",
    "register_off_policy_correction",
    "register_policy_loss",
    "response_quarters",
]
