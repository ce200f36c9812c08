"""Convert raw GSM8K (``question`` / ``answer`` rows, answer ending in ``#### 72``) to prompt rows.

Accepts the files of github.com/openai/grade-school-math (``train.jsonl``, ``test.jsonl``) or the
Hugging Face ``openai/gsm8k`` Parquet files, or a folder holding them. Each input file becomes
``<split>.jsonl`` in the output folder, where ``<split>`` is ``train`` or ``test`` when the file
name says so (``gsm8k_train.jsonl``, ``train-00000-of-00001.parquet`` -> ``train.jsonl``), which are
the names the GSM8K recipes read.
"""

from __future__ import annotations

import os
import re
from typing import Any

from rlcli.data.rows import SUPPORTED_EXTENSIONS, RowLocation, read_rows, write_jsonl
from rlcli.errors import UserError

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
_FINAL_ANSWER = re.compile(r"####\s*\$?\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)")


def extract_gsm8k_ground_truth(answer: str) -> str | None:
    """The number after ``####`` in a GSM8K reference answer, commas removed; None if absent."""
    match = _FINAL_ANSWER.search(answer)
    return match.group(1).replace(",", "") if match else None


def gsm8k_row(question: str, answer: str, split: str, index: int, location: RowLocation) -> dict:
    """One prompt row in the verl schema for a raw GSM8K question/answer pair."""
    ground_truth = extract_gsm8k_ground_truth(answer)
    if ground_truth is None:
        raise UserError(f"{location}: key 'answer' has no final '#### <number>' line")
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": split, "index": index, "question": question, "answer": answer},
    }


def convert_gsm8k(input_path: str, output_dir: str) -> dict[str, int]:
    """Convert a raw GSM8K file (or every ``.jsonl``/``.parquet`` file in a folder).

    Returns the number of rows written per split, e.g. ``{"train": 7473, "test": 1319}``;
    the rows are in ``<output_dir>/<split>.jsonl``.
    """
    if os.path.isdir(input_path):
        inputs = sorted(
            os.path.join(input_path, name)
            for name in os.listdir(input_path)
            if name.lower().endswith(SUPPORTED_EXTENSIONS)
        )
        if not inputs:
            raise UserError(
                f"no .jsonl or .parquet files in {input_path}: point --input at GSM8K's "
                "train.jsonl / test.jsonl"
            )
    else:
        inputs = [input_path]

    counts: dict[str, int] = {}
    for path in inputs:
        split = split_of(path)
        if split in counts:
            raise UserError(f"two input files map to the split {split!r}; convert them one by one")
        rows = [
            _convert_row(location, row, split, index)
            for index, (location, row) in enumerate(read_rows(path))
        ]
        if not rows:
            raise UserError(f"{path} has no rows")
        counts[split] = write_jsonl(os.path.join(output_dir, f"{split}.jsonl"), rows)
    return counts


def split_of(path: str) -> str:
    """The split a raw file holds: ``train`` or ``test`` when its name says so as a word
    (``gsm8k_train.jsonl``, ``train-00000-of-00001.parquet``), else its name up to the first
    ``.`` or ``-``."""
    stem = os.path.basename(path).split(".")[0]
    words = re.split(r"[^a-z0-9]+", stem.lower())
    for split in ("train", "test"):
        if split in words:
            return split
    return stem.split("-")[0]


def _convert_row(location: RowLocation, row: dict[str, Any], split: str, index: int) -> dict:
    for key in ("question", "answer"):
        if not isinstance(row.get(key), str):
            raise UserError(
                f"{location}: missing key {key!r} (raw GSM8K rows have question/answer)"
            )
    return gsm8k_row(row["question"], row["answer"], split, index, location)
