"""Competition math: the last ``\\boxed{...}`` of the response, checked with math-verify.

math-verify compares the expressions symbolically (``\\frac{1}{2}`` equals ``0.5``,
``x(x+2)`` equals ``x^2+2x``). Its own timeouts use ``signal.alarm``, which only works in the
main thread; elsewhere they are switched off and the caller bounds the time.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

from rlcli.rewards.registry import register_reward

_TIMEOUT_S = 5


def last_boxed_content(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced; or None."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    brace = text.find("{", start)
    if brace < 0:
        return None
    depth = 0
    for position in range(brace, len(text)):
        if text[position] == "{":
            depth += 1
        elif text[position] == "}":
            depth -= 1
            if depth == 0:
                return text[brace + 1 : position]
    return None


def _timeout() -> int | None:
    return _TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


@functools.lru_cache(maxsize=4096)
def _parse_gold(ground_truth: str, timeout: int | None) -> list:
    from math_verify import parse

    # A bare answer ("\frac{1}{2}") is wrapped as LaTeX math so math-verify reads it as such.
    text = ground_truth if "\\boxed" in ground_truth or "$" in ground_truth else f"${ground_truth}$"
    return parse(text, parsing_timeout=timeout)


@register_reward("math", in_process=True)
def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None = None,
) -> dict[str, float]:
    """``{"score": 1.0, "acc": 1.0}`` when the last boxed answer equals the ground truth."""
    from math_verify import parse, verify

    content = last_boxed_content(solution_str)
    if content is None:
        return {"score": 0.0, "acc": 0.0}
    timeout = _timeout()
    gold = _parse_gold(str(ground_truth), timeout)
    answer = parse(f"\\boxed{{{content}}}", parsing_timeout=timeout)
    correct = bool(gold) and bool(answer) and verify(gold, answer, timeout_seconds=timeout)
    return {"score": float(correct), "acc": float(correct)}
