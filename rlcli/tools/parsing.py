"""Tool calls in an assistant turn's text, by format (``rollout.multi_turn.format``).

A parser never raises on the model's text: a call it cannot read becomes a ``MalformedToolCall``
whose ``error`` is the tool response the model gets, so it can correct itself. Unknown tools and
arguments that do not fit a schema are checked later, by the tools (``TrajectoryTools.call``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from algorithms.registry import Registry
from rlcli.errors import UserError


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: Any  # a dict when the model wrote one; checked against the tool's schema later


@dataclass(frozen=True)
class MalformedToolCall:
    error: str  # the tool response for this call
    raw: str  # the text of the call as written


@dataclass
class ParsedTurn:
    content: str  # the turn's text without its tool calls
    calls: list[ToolCall | MalformedToolCall] = field(default_factory=list)


ToolCallParser = Callable[[str], ParsedTurn]
TOOL_CALL_FORMATS: Registry[ToolCallParser] = Registry(
    "tool-call format", error=UserError, key="rollout.multi_turn.format"
)
# Decorator registering a parser ``text -> ParsedTurn`` under a name.
register_tool_call_format = TOOL_CALL_FORMATS.register
# The parser registered under a name; UserError listing the formats otherwise.
get_tool_call_parser = TOOL_CALL_FORMATS.lookup


_HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
HERMES_EXAMPLE = '<tool_call>{"name": "<tool name>", "arguments": {...}}</tool_call>'


@register_tool_call_format("hermes")
def parse_hermes(text: str) -> ParsedTurn:
    """Hermes / Qwen2.5 calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any
    number per turn. ``arguments`` may also be a JSON string holding the object (some models
    write it so); a missing ``arguments`` is ``{}``. A ``<tool_call>`` never closed (the turn was
    cut) is malformed."""
    calls: list[ToolCall | MalformedToolCall] = []
    pieces = []
    end = 0
    for number, match in enumerate(_HERMES_CALL.finditer(text), start=1):
        pieces.append(text[end : match.start()])
        end = match.end()
        calls.append(_hermes_call(match.group(1), match.group(0), number))
    rest = text[end:]
    open_at = rest.find("<tool_call>")
    if open_at >= 0:
        calls.append(
            MalformedToolCall(
                f"Error: tool call {len(calls) + 1} has no closing </tool_call>; write "
                f"{HERMES_EXAMPLE}",
                rest[open_at:],
            )
        )
        rest = rest[:open_at]
    pieces.append(rest)
    return ParsedTurn("".join(pieces).strip(), calls)


def _hermes_call(body: str, raw: str, number: int) -> ToolCall | MalformedToolCall:
    def malformed(problem: str) -> MalformedToolCall:
        return MalformedToolCall(
            f"Error: tool call {number} {problem}; write {HERMES_EXAMPLE}", raw
        )

    try:
        call = json.loads(body)
    except json.JSONDecodeError as error:
        return malformed(f"is not valid JSON ({error.msg} at character {error.pos})")
    if not isinstance(call, dict):
        return malformed(f"must be a JSON object, got {type(call).__name__}")
    name = call.get("name")
    if not isinstance(name, str) or not name:
        return malformed('has no "name" string')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as error:
            return malformed(f'has "arguments" that are not valid JSON ({error.msg})')
    if not isinstance(arguments, dict):
        return malformed(f'has "arguments" that are not a JSON object ({type(arguments).__name__})')
    return ToolCall(name, arguments)
