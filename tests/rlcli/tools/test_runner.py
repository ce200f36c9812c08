"""One turn's tool calls run concurrently with per-call timeouts; limits and metrics."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from rlcli.tools.parsing import parse_hermes
from rlcli.tools.runner import ToolRunner, tool_metrics
from rlcli.tools.tool_config import ToolSet, load_tool_config
from tests.rlcli.tools import user_tools

TOOLS = ["calculator", *(f"tests.rlcli.tools.user_tools:{c}" for c in ("SleepTool", "FailingTool"))]


@pytest.fixture
def tools(tmp_path: Path) -> ToolSet:
    path = tmp_path / "tools.yaml"
    path.write_text(yaml.safe_dump({"tools": TOOLS}))
    return ToolSet(load_tool_config(path))


def _call(name, **arguments):
    import json

    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def test_calls_across_trajectories_run_at_the_same_time(tools):
    runner = ToolRunner(timeout_s=10, max_calls_per_turn=4, max_concurrent=16)
    user_tools.SleepTool.most_at_once = 0
    turns = [parse_hermes(_call("sleep", seconds=0.5) * 2).calls for _ in range(4)]
    start = time.monotonic()
    outcomes = runner.run_turn([(tools.for_trajectory({}), calls) for calls in turns])
    elapsed = time.monotonic() - start
    assert [[o.text for o in row] for row in outcomes] == [["slept 0.5"] * 2] * 4
    assert user_tools.SleepTool.most_at_once == 8
    assert elapsed < 0.5 * 8 / 2, elapsed  # far below the 4 s of running them one by one
    runner.close()


def test_a_slow_call_times_out_without_stalling_the_others(tools):
    runner = ToolRunner(timeout_s=0.5, max_calls_per_turn=4)
    slow = parse_hermes(_call("sleep", seconds=5)).calls
    fast = parse_hermes(_call("calculator", expression="6 * 7")).calls
    start = time.monotonic()
    [[timed_out], [answer]] = runner.run_turn(
        [(tools.for_trajectory({}), slow), (tools.for_trajectory({}), fast)]
    )
    assert time.monotonic() - start < 1.5
    assert (
        timed_out.status == "timeout"
        and timed_out.text == "Error: sleep did not answer within 0.5 s"
    )
    assert answer.status == "ok" and answer.text == "42" and answer.latency_s < 0.5
    runner.close()


def test_errors_limits_and_metrics(tools):
    runner = ToolRunner(timeout_s=5, max_calls_per_turn=3)
    text = (
        _call("calculator", expression="1/0")  # ok: the calculator answers with an error text
        + _call("fail")  # the tool raises
        + "<tool_call>{oops</tool_call>"  # malformed
        + _call("calculator", expression="1")  # over the limit of 3
    )
    [outcomes] = runner.run_turn([(tools.for_trajectory({}), parse_hermes(text).calls)])
    assert [o.status for o in outcomes] == ["ok", "error", "error", "skipped"]
    assert outcomes[0].text == "Error: division by zero"
    assert outcomes[1].text == "Error: fail failed: RuntimeError: the tool broke"
    assert outcomes[2].text.startswith("Error: tool call 3 is not valid JSON")
    assert outcomes[3].text == "Error: at most 3 tool calls run per turn; call 4 was not run"
    metrics = tool_metrics(outcomes)
    assert metrics["tool/calls"] == 4
    assert metrics["tool/error_rate"] == 0.5 and metrics["tool/skipped_rate"] == 0.25
    assert metrics["tool/timeout_rate"] == 0.0
    assert metrics["tool/calculator/error"] == 1.0  # the calculator's own metric, averaged
    assert metrics["tool/latency_max_s"] >= metrics["tool/latency_mean_s"] > 0
    runner.close()


def test_python_tool_under_the_runner(tmp_path):
    import shutil

    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    path = tmp_path / "tools.yaml"
    # 3 s: a sandboxed interpreter's start alone took over 1 s on a loaded 2-core machine
    path.write_text(yaml.safe_dump({"tools": [{"class": "python", "config": {"wall_time_s": 3}}]}))
    tools = ToolSet(load_tool_config(path))
    runner = ToolRunner(timeout_s=8, max_calls_per_turn=4)
    calls = parse_hermes(
        _call("python", code="print(6 * 7)") + _call("python", code="import time; time.sleep(9)")
    ).calls
    [[answer, killed]] = runner.run_turn([(tools.for_trajectory({}), calls)])
    assert answer.text == "42\n" and answer.status == "ok"
    assert killed.status == "ok" and killed.text.startswith("[timed out after 3 s")
    assert tool_metrics([answer, killed])["tool/python/timed_out"] == 0.5
    runner.close()


def test_empty_turns():
    runner = ToolRunner(timeout_s=1, max_calls_per_turn=1)
    assert runner.run_turn([]) == []
    assert tool_metrics([]) == {"tool/calls": 0.0}
    runner.close()
