"""``running_sum``: a multi-step addition dialogue in the quickstart's format.

The row's prompt asks the first sum (``Question: 3 + 4 = ? Answer:``); ``extra_info
.interaction_kwargs.numbers`` lists all the addends (``[3, 4, 5]``). After each correct answer
(``#### 7``) the environment asks to add the next number to it (``Question: 7 + 5 = ? Answer:``);
the dialogue ends at the first wrong answer or after the last number. The reward is the share of
the steps answered correctly: 1.0 for a dialogue solved to the end.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from rlcli.environments.base import Environment, EnvironmentResponse
from rlcli.errors import UserError

_ANSWER = re.compile(r"####\s*(-?\d+)")


def question(a: int, b: int) -> str:
    return f"Question: {a} + {b} = ? Answer:"


class RunningSumEnvironment(Environment):
    """State: the addends and how many steps were answered correctly."""

    def start(self, interaction_kwargs: Mapping[str, Any]) -> dict[str, Any]:
        numbers = interaction_kwargs.get("numbers")
        if (
            not isinstance(numbers, list)
            or len(numbers) < 2
            or not all(isinstance(n, int) and not isinstance(n, bool) for n in numbers)
        ):
            raise UserError(
                "running_sum: extra_info.interaction_kwargs.numbers must be a list of at least "
                f"two integers, got {numbers!r}"
            )
        return {"numbers": numbers, "correct": 0}

    def respond(self, state: dict[str, Any], assistant_text: str) -> EnvironmentResponse:
        numbers, correct = state["numbers"], state["correct"]
        steps = len(numbers) - 1
        expected = sum(numbers[: correct + 2])
        answers = _ANSWER.findall(assistant_text)
        if not answers or int(answers[-1]) != expected:
            return self._finish(correct, steps)
        state["correct"] = correct = correct + 1
        if correct == steps:
            return self._finish(correct, steps)
        return EnvironmentResponse(question(expected, numbers[correct + 1]), done=False)

    @staticmethod
    def _finish(correct: int, steps: int) -> EnvironmentResponse:
        return EnvironmentResponse(
            "", done=True, reward=correct / steps, metrics={"correct_steps": float(correct)}
        )
