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
