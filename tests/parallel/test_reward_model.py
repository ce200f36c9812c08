"""parallel.reward_model / parallel.reward_training: a sequence-classification reward model on
Megatron against HF transformers, Bradley-Terry training and export (one torchrun launch for
TP2, PP2 and DP2; see reward_model_worker.py), and the folder checks (single process)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from parallel.reward_model import reward_model_problem, score_positions
from tests.parallel.dist_utils import REPO_ROOT, make_tiny_hf_model, run_torchrun


@pytest.fixture(scope="module")
def tiny_reward_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("reward_models")
    head = "sequence_classification"
    return {
        "qwen2": make_tiny_hf_model(root / "qwen2", "qwen2", seed=3, head=head, pad_token_id=0),
        "llama": make_tiny_hf_model(root / "llama", "llama", seed=4, head=head, pad_token_id=0),
    }


@pytest.mark.dist
def test_reward_model_matches_hf_trains_and_exports_at_tp2_pp2_dp2(
    tiny_reward_models, tiny_qwen2_dir, tmp_path
):
    output = run_torchrun(
        REPO_ROOT / "tests/parallel/reward_model_worker.py",
        2,
        tiny_reward_models["qwen2"],
        tiny_reward_models["llama"],
        tiny_qwen2_dir,
        tmp_path,
        timeout_s=900,
    )
    print("\n".join(line for line in output.splitlines() if line.startswith("REWARD_MODEL")))
    assert "REWARD_MODEL_WORKER_OK" in output, output[-3000:]
    assert output.count("REWARD_MODEL tp=") == 3, output[-3000:]


def test_score_positions_follow_hf_pad_rule():
    input_ids = torch.tensor([[5, 6, 7, 0, 0], [5, 0, 7, 8, 9], [5, 6, 0, 0, 0]])
    attention_mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    # row 2: the real tokens at 2..3 equal the pad id, so the score is read at 1 (as HF does)
    assert score_positions(input_ids, attention_mask, 0).tolist() == [2, 4, 1]
    assert score_positions(input_ids, attention_mask, None).tolist() == [2, 4, 3]


def test_reward_model_folder_checks(tiny_reward_models, tiny_qwen2_dir, tmp_path):
    assert reward_model_problem(tiny_reward_models["qwen2"]) is None
    causal = reward_model_problem(tiny_qwen2_dir)
    assert "not a sequence-classification model" in causal and "Qwen2ForCausalLM" in causal
    assert reward_model_problem(tiny_qwen2_dir, from_language_model=True) is None

    two_labels = make_tiny_hf_model(
        tmp_path / "two", "qwen2", head="sequence_classification", num_labels=2
    )
    assert "2 labels" in reward_model_problem(two_labels)

    config = json.loads((tiny_reward_models["llama"] / "config.json").read_text())
    headless = tmp_path / "headless"
    make_tiny_hf_model(headless, "llama")  # causal LM weights, no score.weight
    (headless / "config.json").write_text(json.dumps(config))
    assert "no score.weight" in reward_model_problem(headless)
    assert "no config.json" in reward_model_problem(tmp_path / "missing")
