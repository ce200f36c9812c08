"""Token-budget micro-batches give the fixed micro-batches' loss and gradients for every
loss_agg_mode, and the on-policy update without the old-log-prob pass equals the full path.

Runs ``token_budget_worker.py`` under torchrun (2 CPU processes) at DP2 and at PP2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.parallel.dist_utils import make_tiny_hf_model, run_torchrun

WORKER = Path(__file__).with_name("token_budget_worker.py")


@pytest.mark.dist
@pytest.mark.parametrize("layout", ["dp2", "pp2"])
def test_token_budget_equals_fixed_micro_batches(layout, tmp_path):
    hf_dir = make_tiny_hf_model(tmp_path / "model")
    out = tmp_path / "result.json"
    run_torchrun(WORKER, 2, layout, str(hf_dir), str(out), timeout_s=300)
    result = json.loads(out.read_text())
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                 "seq-mean-token-sum-norm"):  # fmt: skip
        row = result[mode]
        fixed, budget = row["loss"]
        assert abs(fixed - budget) < 1e-6, (mode, row)
        assert row["grad_diff"] < 1e-6, (mode, row)
        assert row["grad_scale"] > 1e-4, (mode, row)  # the gradients are not trivially zero
        if layout == "dp2":  # sorted by length and trimmed: fewer padded tokens computed
            assert row["padded_tokens"][1] < row["padded_tokens"][0], (mode, row)
    on_policy = result["on_policy"]
    assert on_policy["weight_change"] > 1e-3, on_policy  # the step moved the weights
    assert on_policy["weight_diff"] < 1e-6, on_policy
    full, skip = on_policy["grad_norm"]
    assert abs(full - skip) < 1e-6 * max(1.0, full), on_policy
    # The skipped pass's metrics come from the update's own forward.
    assert on_policy["kl_to_ref_skip"] is not None and on_policy["logprob_diff_mean_skip"] > 0
