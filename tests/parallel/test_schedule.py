"""parallel.schedule: log-probs, entropy, values and gradient semantics against HF transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.parallel.dist_utils import REPO_ROOT, run_torchrun


def make_tiny_critic(out_dir: Path, policy_dir: Path) -> Path:
    """An HF Qwen2ForTokenClassification(num_labels=1) sharing the policy's architecture."""
    from transformers import AutoConfig, Qwen2ForTokenClassification

    config = AutoConfig.from_pretrained(policy_dir)
    config.num_labels = 1
    torch.manual_seed(11)
    model = Qwen2ForTokenClassification(config).to(torch.float32)
    with torch.no_grad():
        model.score.weight.normal_(std=0.5)
        if model.score.bias is not None:
            model.score.bias.fill_(0.3)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


@pytest.mark.dist
def test_schedule_matches_hf_at_tp2_pp2_vpp2(tiny_qwen2_dir: Path, tmp_path: Path) -> None:
    critic_dir = make_tiny_critic(tmp_path / "critic", tiny_qwen2_dir)
    output = run_torchrun(
        REPO_ROOT / "tests/parallel/schedule_worker.py",
        2,
        tiny_qwen2_dir,
        critic_dir,
        timeout_s=600,
    )
    assert "SCHEDULE_WORKER_OK" in output, output[-3000:]
