"""The quickstart addition task: the response must start with ``#### <A+B>``.

The warm start teaches the completion ``" #### <A+B>"`` + EOS, so the answer has to come
first; whatever follows it (text after a missing EOS, or the EOS text itself when the trainer
decodes special tokens) is ignored.
"""

from __future__ import annotations

import re
from typing import Any

from rlcli.errors import UserError
from rlcli.rewards.registry import register_reward

_LEADING_ANSWER = re.compile(r"\s*####\s*(-?\d+)(?![\d.])")


@register_reward("arith", in_process=True)
def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None = None,
) -> dict[str, float]:
    """``{"score": 1.0, "acc": 1.0}`` when the response starts with ``#### <ground_truth>``."""
    try:
        expected = int(str(ground_truth).strip())
    except ValueError as error:
        raise UserError(
            f"arith reward: ground truth {ground_truth!r} is not an integer; "
            "regenerate the data with write_arith_dataset"
        ) from error
    match = _LEADING_ANSWER.match(solution_str)
    correct = match is not None and int(match.group(1)) == expected
    return {"score": float(correct), "acc": float(correct)}
