"""parallel.checkpoint: resume at the same layout, and read back at TP1 and PP2 from TP2."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.parallel.dist_utils import REPO_ROOT, run_torchrun


@pytest.mark.dist
def test_checkpoint_resume_and_reshard(tiny_qwen2_dir: Path, tmp_path: Path) -> None:
    output = run_torchrun(
        REPO_ROOT / "tests/parallel/checkpoint_worker.py",
        2,
        tiny_qwen2_dir,
        tmp_path,
        timeout_s=600,
    )
    assert "CHECKPOINT_WORKER_OK" in output, output[-3000:]
