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


@pytest.mark.parametrize(
    ("values", "finite"),
    [
        ([1.0, -2.0, 3.0], True),
        ([1.0, float("nan"), 3.0], False),
        ([1.0, float("inf"), 3.0], False),
        ([float("inf"), -float("inf")], False),  # the sum is NaN
        ([3.0e38] * 4, True),  # finite values whose float32 sum overflows
    ],
)
def test_the_gradient_check_is_exact(values, finite):
    import torch

    from parallel.optim import _all_finite

    assert _all_finite(torch.tensor(values, dtype=torch.float32)) is finite
    assert _all_finite(torch.tensor(values, dtype=torch.float32).bfloat16()) is finite
