"""MoE routing replay (R2, ``parallel.routing_replay``) on a tiny Qwen2-MoE at DP2 and PP2,
padded and packed: what the routers hand megatron's dispatcher while replaying, read by forward
hooks and laid out per row by hand, is the recorded routing; replaying a pass's own routing
gives its log-probs; the routers still get gradients. Runs ``routing_replay_worker.py`` under
torchrun (2 CPU processes), every layout in one launch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.parallel.dist_utils import make_tiny_hf_model, run_torchrun

WORKER = Path(__file__).with_name("routing_replay_worker.py")


@pytest.mark.dist
def test_replay_sends_tokens_to_the_recorded_experts(tmp_path: Path) -> None:
    hf_dir = make_tiny_hf_model(tmp_path / "model", "qwen2_moe", seed=5)
    out = tmp_path / "result.json"
    run_torchrun(WORKER, 2, str(hf_dir), str(out), timeout_s=600)
    result = json.loads(out.read_text())
    assert set(result) == {"dp2-padded", "dp2-packed", "pp2-padded", "pp2-packed"}
    for layout, ranks in result.items():
        # qwen2_moe's layer 1 is dense: 3 MoE layers, split 1 + 2 over two pipeline stages
        layers = [row["layers"] for row in ranks]
        assert layers == ([3, 3] if layout.startswith("dp2") else [1, 2]), layout
        for row in ranks:
            where = (layout, row["rank"])
            assert row["routing_shape"] == [6, 14, row["layers"], 2], where
            # moving the routers sends some tokens elsewhere, and replay undoes exactly that
            assert 0.05 < row["flipped_share"] < 0.95, where
            assert row["replay_mismatch"] == 0, where
            # what the replay reports as changed is about what the free pass flipped (not
            # exactly: past the first MoE layer, the hidden states follow the replayed experts)
            assert (
                0 < row["changed_share"] and abs(row["changed_share"] - row["flipped_share"]) < 0.1
            ), where
            assert row["w1_free_vs_free_again"] < 1e-5, where
            assert row["own_replay_logprob_diff"] < 1e-5, where
            assert row["router_grad"] > 0, where
        # the routing moved the log-probs (on the last stage's outputs, which every rank holds)
        assert max(row["w0_vs_w1_logprob_diff"] for row in ranks) > 1e-3, layout
