"""3D resharding into colocated vLLM engines, under torchrun (gloo, CPU).

Layouts are bundled into three launches (each vLLM engine costs ~1 GB and seconds of startup):
training TP1 x DP4, TP2 x DP2, PP2 x DP2 and TP2 x PP2 into rollout-TP1 engines (4 processes),
training TP1 x DP2 and PP2 of a tied-embedding model into one rollout-TP2 engine (2
processes), and a Qwen3-MoE at EP2, TP2 x EP2 (expert TP 1) and PP2 into rollout-TP1 engines
(vLLM's fused expert tensors; 2 processes). The worker checks the buckets against the
checkpoint and the naive export, and vLLM's log-probs against Megatron's.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from tests.parallel.dist_utils import make_tiny_hf_model, run_torchrun

WORKER = Path(__file__).with_name("reshard_engine_worker.py")
pytestmark = [
    pytest.mark.dist,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="no vLLM"),
]


# vLLM's CPU attention needs head_dim >= 32: hidden 128 over 4 heads.
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_hf_model(tmp_path_factory.mktemp("qwen2_reshard"), "qwen2", hidden_size=128)


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory) -> Path:
    return make_tiny_hf_model(
        tmp_path_factory.mktemp("qwen2_reshard_tied"),
        "qwen2",
        hidden_size=128,
        tie_word_embeddings=True,
    )


def _layouts_ok(output: str) -> set[str]:
    """TPxPP of each layout that passed, xEP when experts were spread."""
    found = re.findall(r"RESHARD_OK tp=(\d+) pp=(\d+) ep=(\d+)", output)
    return {f"{tp}x{pp}" + (f"x{ep}" if ep != "1" else "") for tp, pp, ep in found}


def test_reshard_into_rollout_tp1_engines(model_dir):
    layouts = ["1x1", "2x1", "1x2", "2x2"]
    output = run_torchrun(WORKER, 4, str(model_dir), "1", *layouts, timeout_s=900)
    assert _layouts_ok(output) == set(layouts), output[-3000:]
    print("\n".join(re.findall(r"RESHARD_OK.*", output)))  # shown with pytest -s


def test_reshard_into_rollout_tp2_engine_tied_embeddings(tied_model_dir):
    # PP2: the last stage's copy of the tied head is not exported; the embedding is.
    layouts = ["1x1", "1x2"]
    output = run_torchrun(WORKER, 2, str(tied_model_dir), "2", *layouts, timeout_s=600)
    assert _layouts_ok(output) == set(layouts), output[-3000:]
    print("\n".join(re.findall(r"RESHARD_OK.*", output)))  # shown with pytest -s


# head_dim 32 (vLLM-CPU's attention needs >= 32), 8 experts, top-2
@pytest.fixture(scope="module")
def moe_model_dir(tmp_path_factory) -> Path:
    return make_tiny_hf_model(tmp_path_factory.mktemp("qwen3_moe_reshard"), "qwen3_moe")


def test_reshard_moe_into_vllm_fused_experts(moe_model_dir):
    # EP2; TP2 x EP2 (expert TP 1); TP2 (each expert split over expert TP 2); PP2
    layouts = ["1x1x2", "2x1x2x1", "2x1", "1x2"]
    output = run_torchrun(WORKER, 2, str(moe_model_dir), "1", *layouts, timeout_s=600)
    assert _layouts_ok(output) == {"1x1x2", "2x1x2", "2x1", "1x2"}, output[-3000:]
    print("\n".join(re.findall(r"RESHARD_OK.*", output)))  # shown with pytest -s
