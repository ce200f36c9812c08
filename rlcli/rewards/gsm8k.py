"""GSM8K: compare the final number of a response with the reference answer.

``method="strict"`` takes the number after the last ``####`` (the format GSM8K references
and the gsm8k prompt instruction use); ``method="flexible"`` takes the last number anywhere.
Numbers may carry a sign, ``$``, thousands separators (``1,234``) and decimals; they are
compared as exact decimals, so ``72.00`` equals ``72``.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

from rlcli.errors import UserError
from rlcli.rewards.registry import register_reward

# A sign and a dollar sign in either order, then 1,234,567 / 1234 / .5, optional decimals.
_NUMBER = r"(?:-\s?\$?|\$\s?-?)?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)"
_STRICT = re.compile(r"####\s*(" + _NUMBER + ")")
_ANY_NUMBER = re.compile(_NUMBER)
METHODS = ("strict", "flexible")


def _to_decimal(text: str) -> Decimal | None:
    cleaned = re.sub(r"[\s$,]", "", text)
    try:
        return Decimal(cleaned)
    except InvalidOperation:
        return None


def extract_answer(solution_str: str, method: str = "strict") -> Decimal | None:
    """The response's final answer as a ``Decimal``, or None when it gives none."""
    if method == "strict":
        matches = _STRICT.findall(solution_str)
    elif method == "flexible":
        matches = _ANY_NUMBER.findall(solution_str)
    else:
        raise UserError(f"gsm8k reward: unknown method {method!r}; valid choices: {METHODS}")
    return _to_decimal(matches[-1]) if matches else None


@register_reward("gsm8k", in_process=True)
def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None = None,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> dict[str, float]:
    """``score`` for a correct final number, ``format_score`` for a wrong one, 0 for none.

    Returns ``{"score": ..., "acc": 1.0 | 0.0}``.
    """
    expected = _to_decimal(str(ground_truth))
    if expected is None:
        raise UserError(
            f"gsm8k reward: ground truth {ground_truth!r} is not a number "
            f"(data_source {data_source!r}); fix reward_model.ground_truth in the data"
        )
    answer = extract_answer(solution_str, method)
    if answer is None:
        return {"score": 0.0, "acc": 0.0}
    correct = answer == expected
    return {"score": score if correct else format_score, "acc": float(correct)}
