"""The default reward: choose a builtin by each row's ``data_source``."""

from __future__ import annotations

from typing import Any

from rlcli.errors import UserError
from rlcli.rewards import arith, gsm8k, math_answer
from rlcli.rewards.registry import register_reward

_BY_DATA_SOURCE = {
    "openai/gsm8k": gsm8k.compute_score,
    "gsm8k": gsm8k.compute_score,
    "arith": arith.compute_score,
    "count_squares": arith.compute_score,  # the vision-language quickstart: " #### N" first
    "tool_multiply": gsm8k.compute_score,  # the tool quickstart: the number after the last ####
}
# verl's math sources ("lighteval/MATH", "HuggingFaceH4/MATH-500", "math_dapo", "aime2024",
# "numina_*", ...) all grade a boxed final answer.
_MATH_MARKERS = ("math", "aime", "amc", "numina")


def reward_fn_for_data_source(data_source: str) -> Any:
    """The builtin reward function for ``data_source``; ``UserError`` for an unknown one."""
    if data_source in _BY_DATA_SOURCE:
        return _BY_DATA_SOURCE[data_source]
    if any(marker in data_source.lower() for marker in _MATH_MARKERS):
        return math_answer.compute_score
    raise UserError(
        f"no builtin reward for data_source {data_source!r}; the default reward knows "
        f"{', '.join(sorted(_BY_DATA_SOURCE))} and math-like sources (names containing "
        f"{', '.join(_MATH_MARKERS)}); choose a reward function: a registered name, "
        "'module:function' or 'path/to/file.py:function'"
    )


@register_reward("default", in_process=True)
def default_compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None = None,
) -> dict[str, float]:
    """Score with the builtin that ``data_source`` names (see ``reward_fn_for_data_source``)."""
    reward_fn = reward_fn_for_data_source(data_source)
    return reward_fn(
        data_source=data_source,
        solution_str=solution_str,
        ground_truth=ground_truth,
        extra_info=extra_info,
    )
