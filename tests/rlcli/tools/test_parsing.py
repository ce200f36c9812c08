"""Hermes / Qwen2.5 tool calls in the model's text; malformed calls become error texts."""

from __future__ import annotations

import pytest

from rlcli.errors import UserError
from rlcli.tools.parsing import (
    TOOL_CALL_FORMATS,
    MalformedToolCall,
    ToolCall,
    get_tool_call_parser,
    parse_hermes,
    register_tool_call_format,
)


def test_several_calls_and_the_text_around_them():
    text = (
        "Let me compute.\n<tool_call>\n"
        '{"name": "calculator", "arguments": {"expression": "123 * 456"}}\n</tool_call>\n'
        '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>'
        "\nDone."
    )
    parsed = parse_hermes(text)
    assert parsed.calls == [
        ToolCall("calculator", {"expression": "123 * 456"}),
        ToolCall("python", {"code": "print(1)"}),  # arguments given as a JSON string
    ]
    assert parsed.content == "Let me compute.\n\n\nDone."


def test_no_calls():
    parsed = parse_hermes("The answer is #### 42")
    assert parsed.calls == [] and parsed.content == "The answer is #### 42"


def test_missing_arguments_mean_an_empty_object():
    assert parse_hermes('<tool_call>{"name": "now"}</tool_call>').calls == [ToolCall("now", {})]


@pytest.mark.parametrize(
    "body, message",
    [
        ('{"name": "calculator", "arguments": {"expression": "1"}', "is not valid JSON"),
        ("not json at all", "is not valid JSON"),
        ('["calculator"]', "must be a JSON object, got list"),
        ('{"arguments": {}}', 'has no "name" string'),
        ('{"name": "", "arguments": {}}', 'has no "name" string'),
        ('{"name": "c", "arguments": [1, 2]}', 'has "arguments" that are not a JSON object'),
        ('{"name": "c", "arguments": "{broken"}', 'has "arguments" that are not valid JSON'),
    ],
)
def test_malformed_calls_give_error_texts(body, message):
    text = (
        f'<tool_call>{{"name": "ok", "arguments": {{}}}}</tool_call><tool_call>{body}</tool_call>'
    )
    first, second = parse_hermes(text).calls
    assert first == ToolCall("ok", {})
    assert isinstance(second, MalformedToolCall)
    assert second.error.startswith("Error: tool call 2 ") and message in second.error
    assert "<tool_call>{" in second.error  # tells the model the expected form
    assert second.raw == f"<tool_call>{body}</tool_call>"


def test_an_unclosed_call_is_malformed():
    parsed = parse_hermes('Sure.\n<tool_call>{"name": "calculator", "argu')
    [call] = parsed.calls
    assert isinstance(call, MalformedToolCall) and "no closing </tool_call>" in call.error
    assert parsed.content == "Sure."


def test_arbitrary_text_never_raises():
    import random

    rng = random.Random(0)
    alphabet = [
        "<tool_call>",
        "</tool_call>",
        "{",
        "}",
        '"name"',
        ":",
        '"x"',
        ",",
        '"arguments"',
        " ",
    ]
    for _ in range(500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        for call in parse_hermes(text).calls:
            assert isinstance(call, (ToolCall, MalformedToolCall))


def test_the_format_registry():
    assert "hermes" in TOOL_CALL_FORMATS
    assert get_tool_call_parser("hermes") is parse_hermes
    with pytest.raises(
        UserError, match="rollout.multi_turn.format='xml': unknown tool-call format; valid names: "
    ):
        get_tool_call_parser("xml")

    @register_tool_call_format("test-upper")
    def parse_upper(text):
        return parse_hermes(
            text.replace("<CALL>", "<tool_call>").replace("</CALL>", "</tool_call>")
        )

    parsed = get_tool_call_parser("test-upper")('<CALL>{"name": "f"}</CALL>')
    assert parsed.calls == [ToolCall("f", {})]
    with pytest.raises(ValueError, match="already registered"):
        register_tool_call_format("hermes")(parse_upper)
