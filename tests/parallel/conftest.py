"""Fixtures for tests/parallel: tiny HF checkpoints on disk (session-scoped, built once)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.parallel.dist_utils import make_tiny_hf_model


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    """Qwen2 with QKV bias and untied embeddings."""
    return make_tiny_hf_model(tmp_path_factory.mktemp("qwen2_untied"), "qwen2")


@pytest.fixture(scope="session")
def tiny_qwen2_tied_dir(tmp_path_factory) -> Path:
    """Qwen2 with tied input / output embeddings."""
    return make_tiny_hf_model(
        tmp_path_factory.mktemp("qwen2_tied"), "qwen2", tie_word_embeddings=True, seed=1
    )


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """Llama without biases, untied embeddings."""
    return make_tiny_hf_model(tmp_path_factory.mktemp("llama"), "llama", seed=2)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory) -> Path:
    """Qwen3 dense: QK-norm, head_dim 32 (heads x head_dim != hidden)."""
    return make_tiny_hf_model(tmp_path_factory.mktemp("qwen3"), "qwen3", seed=3)


@pytest.fixture(scope="session")
def tiny_qwen3_moe_dir(tmp_path_factory) -> Path:
    """Qwen3-MoE: 8 experts, top-2 renormalised, QK-norm."""
    return make_tiny_hf_model(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe", seed=4)


@pytest.fixture(scope="session")
def tiny_qwen2_moe_dir(tmp_path_factory) -> Path:
    """Qwen2-MoE: 8 experts, top-2 not renormalised, a gated shared expert, layer 1 dense."""
    return make_tiny_hf_model(tmp_path_factory.mktemp("qwen2_moe"), "qwen2_moe", seed=5)


@pytest.fixture(scope="session")
def tiny_qwen3_5_dir(tmp_path_factory) -> Path:
    """Qwen3.5 text: Gated DeltaNet layers and a gated full-attention layer (hybrid)."""
    return make_tiny_hf_model(tmp_path_factory.mktemp("qwen3_5"), "qwen3_5", seed=6)


@pytest.fixture(scope="session")
def tiny_qwen3_5_moe_dir(tmp_path_factory) -> Path:
    """Qwen3.5-MoE text: the hybrid layers with 8 experts (top-2) and a gated shared expert."""
    return make_tiny_hf_model(tmp_path_factory.mktemp("qwen3_5_moe"), "qwen3_5_moe", seed=7)


@pytest.fixture(scope="session")
def tiny_qwen3_next_dir(tmp_path_factory) -> Path:
    """Qwen3-Next: DeltaNet projections grouped by key head, layer 1 a dense MLP."""
    return make_tiny_hf_model(tmp_path_factory.mktemp("qwen3_next"), "qwen3_next", seed=8)
