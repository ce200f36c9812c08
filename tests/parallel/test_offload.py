"""parallel.offload round trips, activation recomputation and parallel.memory_terms' byte counts
against real megatron models (torchrun: 1 process at TP1, 2 processes at TP2, PP2, DP2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.parallel.dist_utils import REPO_ROOT, run_torchrun

WORKER = REPO_ROOT / "tests/parallel/offload_worker.py"


@pytest.mark.dist
def test_offload_recompute_and_plan_counts_at_tp1(tiny_qwen2_dir: Path) -> None:
    output = run_torchrun(WORKER, 1, tiny_qwen2_dir, timeout_s=600)
    assert "OFFLOAD_WORKER_OK" in output, output[-3000:]


@pytest.mark.dist
def test_offload_recompute_and_plan_counts_at_tp2_pp2_dp2(tiny_qwen2_dir: Path) -> None:
    output = run_torchrun(WORKER, 2, tiny_qwen2_dir, timeout_s=900)
    assert "OFFLOAD_WORKER_OK" in output, output[-3000:]
