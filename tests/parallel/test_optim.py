"""parallel.optim: megatron DDP + optimizer steps at TP2, PP2 and DP2 (one torchrun launch)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.parallel.dist_utils import REPO_ROOT, run_torchrun


@pytest.mark.dist
def test_train_steps_at_tp2_pp2_dp2(tiny_qwen2_dir: Path) -> None:
    output = run_torchrun(
        REPO_ROOT / "tests/parallel/optim_worker.py", 2, tiny_qwen2_dir, timeout_s=600
    )
    assert "OPTIM_WORKER_OK" in output, output[-3000:]
