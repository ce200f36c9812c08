"""The trainer-vs-engine agreement on the sampled tokens (``rollout/logprob_diff_*``) and the KL to
the reference (``actor/kl_to_ref``), against a hand computation."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from rlcli.model.dp_stats import DataParallelStats
from rlcli.train.actor_update import logprob_agreement, logprob_metrics

ENGINE = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, 9.0]])
TRAINER = torch.tensor([[-1.1, -2.0, -2.0], [-0.5, -0.7, 0.0]])
REFERENCE = torch.tensor([[-1.0, -2.5, 0.0], [-0.25, -0.7, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])  # the last column is padding / a tool
ONE_RANK = DataParallelStats(SimpleNamespace(dp=1))


def test_only_generated_tokens_count():
    sums, largest = logprob_agreement(TRAINER, ENGINE, None, MASK, "kl")
    metrics = logprob_metrics(sums, largest, ONE_RANK, with_ref=False)
    # |diff| on the four masked tokens: 0.1, 0, 0, 0.2 (the unmasked 1.0 and 9.0 are ignored)
    assert metrics["rollout/logprob_diff_mean"] == pytest.approx(0.3 / 4)
    assert metrics["rollout/logprob_diff_max"] == pytest.approx(0.2)
    assert "actor/kl_to_ref" not in metrics


def test_kl_to_the_reference_is_the_masked_mean_of_the_estimator():
    sums, largest = logprob_agreement(TRAINER, ENGINE, REFERENCE, MASK, "low_var_kl")
    metrics = logprob_metrics(sums, largest, ONE_RANK, with_ref=True)
    # low_var_kl (k3) per token: exp(ref - logp) - (ref - logp) - 1
    deltas = [-1.0 + 1.1, -2.5 + 2.0, -0.25 + 0.5, -0.7 + 0.7]
    expected = sum(math.exp(d) - d - 1 for d in deltas) / 4
    assert metrics["actor/kl_to_ref"] == pytest.approx(expected, rel=1e-5)


def test_a_batch_with_nothing_to_compare_reports_no_agreement():
    # No generated tokens (or, with stale rollouts, none sampled by the trainer's weights): a 0.0
    # would read as perfect agreement, so the metrics are left out of that step's row.
    sums, largest = logprob_agreement(TRAINER, ENGINE, None, torch.zeros_like(MASK), "kl")
    assert logprob_metrics(sums, largest, ONE_RANK, with_ref=False) == {}  # mismatch_* too
    with_ref = logprob_metrics(sums, largest, ONE_RANK, with_ref=True)
    assert set(with_ref) == {"actor/kl_to_ref"} and with_ref["actor/kl_to_ref"] == 0.0


def test_the_mismatch_metrics_equal_a_hand_computation():
    """KL(engine || trainer) (k1, k3), chi-square per token and per sequence and the perplexity
    ratio, over the generated tokens only; log-ratios (trainer - engine) row 0: -0.1, 0; row 1:
    0, -0.2."""
    sums, largest = logprob_agreement(TRAINER, ENGINE, None, MASK, "kl")
    metrics = logprob_metrics(sums, largest, ONE_RANK, with_ref=False)
    deltas = [-0.1, 0.0, 0.0, -0.2]
    assert metrics["rollout/mismatch_kl_k1"] == pytest.approx(0.3 / 4, rel=1e-6)
    k3 = sum(math.exp(d) - 1 - d for d in deltas) / 4
    assert metrics["rollout/mismatch_kl_k3"] == pytest.approx(k3, rel=1e-6)
    chi2 = sum(math.exp(2 * d) for d in deltas) / 4 - 1
    assert metrics["rollout/mismatch_chi2_token"] == pytest.approx(chi2, rel=1e-6)
    assert metrics["rollout/mismatch_chi2_seq"] == pytest.approx(
        (math.exp(-0.2) + math.exp(-0.4)) / 2 - 1, rel=1e-6
    )
    # each row's perplexity ratio, trainer over engine: exp(mean of engine - trainer)
    assert metrics["rollout/mismatch_ppl_ratio"] == pytest.approx(
        (math.exp(0.05) + math.exp(0.1)) / 2, rel=1e-6
    )
