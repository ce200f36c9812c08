"""Engines on separate rollout ranks hold the trainer's weights after every sync: Megatron TP2 on
two trainer ranks -> broadcast over the weights group -> a vLLM TP2 engine on two rollout ranks;
the engine's sampled-token log-probs equal the trainer's at the weights that generated them
(separate_sync_worker.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.parallel.dist_utils import make_tiny_hf_model, run_torchrun

WORKER = Path(__file__).with_name("separate_sync_worker.py")


@pytest.mark.dist
@pytest.mark.vllm
def test_engines_on_rollout_ranks_hold_the_trainers_weights_after_each_sync(tmp_path):
    model = make_tiny_hf_model(tmp_path / "model", hidden_size=128, tie_word_embeddings=True)
    output = run_torchrun(WORKER, 4, str(model), timeout_s=900)
    rounds = re.findall(r"SYNC_OK round=(\d+) diff=(\S+)", output)
    assert [int(r) for r, _ in rounds] == [0, 1, 2], output[-3000:]
    print("\n".join(re.findall(r"SYNC_OK.*", output)))  # shown with pytest -s
