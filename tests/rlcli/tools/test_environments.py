"""Environments: the built-in running_sum dialogue, user environments by module path."""

from __future__ import annotations

from typing import Any

import pytest

from rlcli.environments.base import BUILTIN_ENVIRONMENTS, resolve_environment_class
from rlcli.environments.running_sum import RunningSumEnvironment, question
from rlcli.errors import UserError


def running_sum_row(numbers: list[int], index: int, split: str = "train") -> dict[str, Any]:
    """A prompt row for the running_sum environment (verl's schema; the ground truth is the
    final sum)."""
    return {
        "data_source": "running_sum",
        "agent_name": "environment",
        "prompt": [{"role": "user", "content": question(numbers[0], numbers[1])}],
        "reward_model": {"style": "rule", "ground_truth": str(sum(numbers))},
        "extra_info": {"split": split, "index": index, "interaction_kwargs": {"numbers": numbers}},
    }


def test_running_sum_dialogue_solved_to_the_end():
    env = RunningSumEnvironment()
    row = running_sum_row([3, 4, 5, 10], index=0)
    assert row["prompt"] == [{"role": "user", "content": "Question: 3 + 4 = ? Answer:"}]
    assert row["reward_model"]["ground_truth"] == "22"
    state = env.start(row["extra_info"]["interaction_kwargs"])
    first = env.respond(state, " #### 7")
    assert (first.text, first.done, first.reward) == ("Question: 7 + 5 = ? Answer:", False, None)
    second = env.respond(state, "so #### 12")
    assert second.text == "Question: 12 + 10 = ? Answer:" and not second.done
    last = env.respond(state, " #### 22")
    assert last.done and last.reward == 1.0 and last.metrics == {"correct_steps": 3.0}


def test_running_sum_stops_at_the_first_wrong_answer():
    env = RunningSumEnvironment()
    state = env.start({"numbers": [3, 4, 5]})
    assert not env.respond(state, " #### 7").done
    wrong = env.respond(state, " #### 13")
    assert wrong.done and wrong.reward == 0.5
    no_answer = env.respond(env.start({"numbers": [1, 1]}), "I do not know")
    assert no_answer.done and no_answer.reward == 0.0


def test_running_sum_checks_its_kwargs():
    with pytest.raises(
        UserError, match="interaction_kwargs.numbers must be a list of at least two"
    ):
        RunningSumEnvironment().start({"numbers": [1]})


def test_registry_and_user_environments():
    assert BUILTIN_ENVIRONMENTS.names() == ["running_sum"]
    assert resolve_environment_class("running_sum") is RunningSumEnvironment
    echo_cls = resolve_environment_class("tests.rlcli.tools.user_environments:EchoEnvironment")
    echo = echo_cls({"turns": 1})
    state = echo.start({})
    assert echo.respond(state, "hi").text == "you said: hi"
    assert echo.respond(state, "bye").done
    with pytest.raises(UserError, match="is not an environment class"):
        resolve_environment_class("tests.rlcli.tools.user_environments:NotAnEnvironment")
    with pytest.raises(
        UserError, match="'nope': unknown environment; valid names: running_sum, or 'module:Class'"
    ):
        resolve_environment_class("nope")
