"""The actor's loss applies ``algorithm.off_policy_correction`` with the ENGINE's log-probs as the
behaviour policy and the batch's old log-probs as the proximal one: the hand-computed example of
tests/algorithms/test_off_policy.py, through ``make_actor_loss`` on a collated batch."""

from __future__ import annotations

import pytest
import torch

from algorithms import MISMATCH_SUMS
from parallel.step_types import ModelOutputs
from rlcli.config.schema import RLConfig
from rlcli.rollout.batch import Sample, collate
from rlcli.train.actor_update import make_actor_loss
from tests.algorithms.test_off_policy import ADVANTAGES, BEHAVIOUR, CURRENT, PROXIMAL


def actor_loss(correction: str, staleness: int = 1) -> tuple[float, dict]:
    sample = Sample(
        group=0,
        prompt_ids=[1, 2],
        response_ids=[3, 4, 5],
        engine_log_probs=BEHAVIOUR[0].tolist(),
        finish_reason="stop",
        item=None,
        staleness=staleness,
    )
    batch = collate([sample], pad_id=0)
    batch.old_log_probs = PROXIMAL
    batch.advantages = ADVANTAGES
    cfg = RLConfig()
    cfg.algorithm.off_policy_correction = correction
    cfg.algorithm.tis_cap = 2.0
    per_position = torch.zeros(1, 4)  # [B, S - 1]: response token j is scored at 1 + j
    per_position[0, 1:] = CURRENT[0]
    loss_fn = make_actor_loss(cfg, torch.tensor(3.0), record_agreement=True)
    loss, report = loss_fn(ModelOutputs(log_probs=per_position), batch)
    return loss.item(), report


def test_the_actor_loss_corrects_with_the_engine_log_probs():
    loss, report = actor_loss("decoupled_ppo")
    assert loss == pytest.approx(-0.83, abs=1e-6)
    assert report.metrics["actor/is_weight_mean"] == pytest.approx((1.2 + 2 + 0.75) / 3, abs=1e-6)
    assert actor_loss("tis")[0] == pytest.approx(-2.81 / 3, abs=1e-6)
    assert actor_loss("none")[0] == pytest.approx((-1.2 - 0.9 + 1.0) / 3, abs=1e-6)


def test_log_prob_agreement_counts_only_rows_of_the_trainers_weights():
    """A stale row's engine log-probs come from other weights: no agreement is measured on it."""
    _, stale = actor_loss("decoupled_ppo", staleness=1)
    _, fresh = actor_loss("decoupled_ppo", staleness=0)
    # logprob_agreement's sums: |diff| sum, tokens, KL sum, KL tokens, then the mismatch sums
    diff_sum, diff_tokens, _, kl_tokens = stale.sums.tolist()[:4]
    assert diff_tokens == 0.0 and kl_tokens == 0.0
    assert dict(zip(MISMATCH_SUMS, stale.sums.tolist()[4:], strict=True))["tokens"] == 0.0
    diff_sum, diff_tokens, _, _ = fresh.sums.tolist()[:4]
    assert diff_tokens == 3.0
    assert diff_sum == pytest.approx((CURRENT - BEHAVIOUR).abs().sum().item(), rel=1e-6)
