"""model.attention_backend=sdpa gives megatron's local attention's logits, and packed sequences
(actor.pack_sequences) give the padded path's log-probs, entropy, losses, gradients, update and
critic values, at TP2, PP2 and DP2. Runs ``packing_worker.py`` under torchrun (2 CPU processes),
all three layouts in one launch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.parallel.dist_utils import make_tiny_hf_model, run_torchrun
from tests.parallel.test_schedule import make_tiny_critic
from tests.rlcli.token_budget_worker import AGG_MODES

WORKER = Path(__file__).with_name("packing_worker.py")


@pytest.mark.dist
def test_sdpa_and_packed_sequences_equal_the_local_padded_path(tmp_path):
    hf_dir = make_tiny_hf_model(tmp_path / "model")
    critic_dir = make_tiny_critic(tmp_path / "critic", hf_dir)
    out = tmp_path / "result.json"
    run_torchrun(WORKER, 2, str(hf_dir), str(critic_dir), str(out), timeout_s=600)
    result = json.loads(out.read_text())
    assert set(result) == {"tp2", "pp2", "dp2"}
    for layout, ranks in result.items():
        for row in ranks:
            where = (layout, row)
            if "logits_sdpa_vs_local" in row:  # last pipeline stage
                assert row["logits_sdpa_vs_local"] < 1e-5, where
                assert row["logits_sdpa_vs_hf"] < 1e-5 and row["logits_scale"] > 0.1, where
            assert row["logprob_sdpa_vs_local"] < 1e-5, where
            assert row["log_probs"] < 1e-6 and row["entropy"] < 1e-6, where
            for mode in AGG_MODES:
                fixed, packed = row[mode]["loss"]
                assert abs(fixed - packed) < 1e-6, (mode, where)
                assert row[mode]["grad_diff"] < 1e-6, (mode, where)
                assert row[mode]["grad_scale"] > 1e-4, (mode, where)  # not trivially zero
                assert max(row[mode]["packed_tokens"]) <= 40, (mode, where)  # the budget
            assert row["update"]["weight_change"] > 1e-3, where  # the step moved the weights
            assert row["update"]["weight_diff"] < 1e-6, where
            # fp32 rounding relative to the values (|values| up to ~13 from the random head)
            assert row["values"] < 1e-6 * row["values_scale"] and row["values_scale"] > 1, where
