"""User tools loaded by file path in the tool tests (``tests/rlcli/tools/user_tools.py:Class``)."""

from __future__ import annotations

import threading
import time

from rlcli.tools.base import Tool, ToolResult
from rlcli.tools.schema import ToolSchema

CREATED: list[dict] = []
RELEASED: list[dict] = []


class LookupTool(Tool):
    """Answers keys from the trajectory's table (its create_kwargs); rewards a hit."""

    schema = ToolSchema(
        "lookup",
        "Look up a key.",
        {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
    )

    def create(self, create_kwargs):
        state = {"table": dict(create_kwargs.get("table", {})), "calls": 0}
        CREATED.append(state)
        return state

    def execute(self, state, arguments):
        state["calls"] += 1
        value = state["table"].get(arguments["key"])
        if value is None:
            return ToolResult(f"no entry for {arguments['key']}", reward=0.0)
        return ToolResult(str(value), reward=1.0, metrics={"hit": 1.0})

    def release(self, state):
        RELEASED.append(state)


class SleepTool(Tool):
    """Sleeps for the given seconds; records how many calls overlapped."""

    schema = ToolSchema(
        "sleep",
        "Sleep.",
        {"type": "object", "properties": {"seconds": {"type": "number"}}, "required": ["seconds"]},
    )
    running = 0
    most_at_once = 0
    lock = threading.Lock()

    def execute(self, state, arguments):
        cls = type(self)
        with cls.lock:
            cls.running += 1
            cls.most_at_once = max(cls.most_at_once, cls.running)
        try:
            time.sleep(arguments["seconds"])
        finally:
            with cls.lock:
                cls.running -= 1
        return ToolResult(f"slept {arguments['seconds']}")


class FailingTool(Tool):
    schema = ToolSchema("fail", "Always raises.", {"type": "object"})

    def execute(self, state, arguments):
        raise RuntimeError("the tool broke")


class NoSchemaTool(Tool):
    """Has no class schema: a tool config entry must give one."""

    def execute(self, state, arguments):
        return ToolResult("ok")


class MissingExecute(Tool):
    """Does not implement execute (abstract)."""


class NotATool:
    def execute(self, state, arguments):
        return ToolResult("not a tool")
