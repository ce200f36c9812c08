"""A small quickstart-shaped model for the tests that train on the arith task: a tokenizer
trained on the task's SFT text, random weights."""

from __future__ import annotations

from pathlib import Path


def build_arith_model(root: Path, **spec: int) -> Path:
    """Write the arith data under ``root/data`` and a model of ``spec`` (``ModelBuildConfig``
    fields) into ``root/model``; returns the model folder."""
    from rlcli.config.model import ModelBuildConfig
    from rlcli.data import read_sft_pairs, write_arith_dataset
    from rlcli.model.builder import build_model_dir

    paths = write_arith_dataset(str(root / "data"))
    corpus = [p + r for p, r in read_sft_pairs(paths["sft_train"])]
    return build_model_dir(ModelBuildConfig(**spec), root / "model", corpus, seed=1)
