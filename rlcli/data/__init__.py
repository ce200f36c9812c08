"""Prompt data: verl-schema datasets (JSONL / Parquet), a resumable loader, task converters;
preference pairs for reward models are ``rlcli.data.preferences``."""

from rlcli.data.dataset import PromptDataset, PromptItem, load_prompt_dataset
from rlcli.data.gsm8k import convert_gsm8k
from rlcli.data.loader import PromptLoader
from rlcli.data.rows import read_rows, write_jsonl
from rlcli.data.synthetic import (
    ArithExample,
    arith_split,
    read_sft_pairs,
    write_arith_dataset,
    write_arith_preferences,
)

__all__ = [
    "ArithExample",
    "PromptDataset",
    "PromptItem",
    "PromptLoader",
    "arith_split",
    "convert_gsm8k",
    "load_prompt_dataset",
    "read_rows",
    "read_sft_pairs",
    "write_arith_dataset",
    "write_arith_preferences",
    "write_jsonl",
]
