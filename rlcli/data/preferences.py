"""Pairwise preference data for reward-model training (``rlcli rm``).

One row (JSONL line or Parquet row)::

    {"prompt": [{"role": "user", "content": "What is 2 + 3?"}],
     "chosen": "2 + 3 = 5.",
     "rejected": "2 + 3 = 6.",
     "margin": 1.0}                      # optional: how far chosen should lead

``prompt`` is chat messages or a string (one user message), as in prompt rows; ``chosen`` and
``rejected`` are the two responses, each a string or a one-message list
``[{"role": "assistant", "content": ...}]`` (the conversational form TRL writes). The pair is
tokenised with the reward model's own tokenizer and chat template
(``rlcli.data.chat.encode_prompt_and_response``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from parallel.preference_pairs import TokenizedPairs
from rlcli.data.chat import encode_prompt_and_response, uses_chat_template
from rlcli.data.dataset import parse_messages
from rlcli.data.rows import RowLocation, read_rows
from rlcli.errors import UserError

logger = logging.getLogger(__name__)

PROMPT_KEY, CHOSEN_KEY, REJECTED_KEY, MARGIN_KEY = "prompt", "chosen", "rejected", "margin"


@dataclass(frozen=True)
class PreferenceRow:
    """One preference pair as read: ``origin`` is ``file, line N`` / ``file, row N``."""

    prompt: list[dict[str, str]]
    chosen: str
    rejected: str
    margin: float | None
    origin: str


def _response(row: dict[str, Any], key: str, location: RowLocation) -> str:
    value = row.get(key)
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], dict):
        if value[0].get("role") == "assistant" and isinstance(value[0].get("content"), str):
            return value[0]["content"]
    if isinstance(value, str):
        return value
    which = "preferred" if key == CHOSEN_KEY else "dispreferred"
    got = "missing" if value is None else f"got {value!r:.80}"
    raise UserError(
        f"{location}: key {key!r} must be the {which} response (a string or "
        f'[{{"role": "assistant", "content": ...}}]), {got}; keys present: {sorted(row)}'
    )


def _parse_row(location: RowLocation, row: dict[str, Any]) -> PreferenceRow:
    if row.get(PROMPT_KEY) is None:
        raise UserError(
            f"{location}: missing key {PROMPT_KEY!r} (the chat messages or text both responses "
            f"answer); keys present: {sorted(row)}"
        )
    margin = row.get(MARGIN_KEY)
    if margin is not None and (isinstance(margin, bool) or not isinstance(margin, int | float)):
        raise UserError(f"{location}: key {MARGIN_KEY!r} must be a number, got {margin!r:.40}")
    return PreferenceRow(
        prompt=parse_messages(row[PROMPT_KEY], location, PROMPT_KEY),
        chosen=_response(row, CHOSEN_KEY, location),
        rejected=_response(row, REJECTED_KEY, location),
        margin=None if margin is None else float(margin),
        origin=str(location),
    )


def read_preference_rows(files: list[str], key: str = "rm.train_files") -> list[PreferenceRow]:
    """Every row of `files` (``.jsonl`` / ``.parquet``), checked; UserError naming the file and
    row for a bad one, or naming `key` when there are none."""
    if not files:
        raise UserError(f"{key} is empty: give JSONL / Parquet files of preference rows")
    rows = [_parse_row(location, row) for path in files for location, row in read_rows(path)]
    if not rows:
        raise UserError(f"{key}: no preference rows in {', '.join(files)}")
    margins = {row.margin is None for row in rows}
    if len(margins) > 1:
        raise UserError(
            f"{key}: some rows of {', '.join(files)} have a {MARGIN_KEY!r} and some do not; "
            "give every row one or none"
        )
    return rows


def tokenize_preferences(
    rows: list[PreferenceRow],
    tokenizer: Any,
    *,
    max_length: int | None = None,
    apply_chat_template: bool | None = None,
) -> tuple[TokenizedPairs, int]:
    """The pairs as token ids of `tokenizer` (prompt + response each) and how many were dropped
    because a sequence is longer than `max_length` tokens (None keeps all)."""
    use_template = uses_chat_template(tokenizer, apply_chat_template)
    chosen, rejected, margins, dropped = [], [], [], 0
    for row in rows:
        pair = [
            encode_prompt_and_response(tokenizer, row.prompt, text, use_template=use_template)
            for text in (row.chosen, row.rejected)
        ]
        if max_length is not None and max(map(len, pair)) > max_length:
            dropped += 1
            continue
        chosen.append(pair[0])
        rejected.append(pair[1])
        margins.append(row.margin)
    if dropped:
        logger.warning(
            "dropped %d of %d preference pairs longer than %s tokens",
            dropped,
            len(rows),
            max_length,
        )
    has_margins = bool(margins) and margins[0] is not None
    return TokenizedPairs(chosen, rejected, margins if has_margins else None), dropped
