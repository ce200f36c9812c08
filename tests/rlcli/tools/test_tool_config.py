"""The tool config and the tool interface: built-in and user tools, schemas checked with
jsonschema, the per-trajectory lifecycle, and the config checks that exit 2 naming the file."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rlcli.errors import UserError
from rlcli.tools.calculator import CalculatorTool
from rlcli.tools.registry import builtin_tool_names, resolve_tool_class
from rlcli.tools.schema import ToolSchema, parse_tool_schema
from rlcli.tools.tool_config import ToolCallRejected, ToolSet, load_tool_config
from tests.rlcli.tools import user_tools

USER_TOOLS = Path(user_tools.__file__)


def _write(tmp_path: Path, tools) -> Path:
    path = tmp_path / "tools.yaml"
    path.write_text(yaml.safe_dump({"tools": tools}))
    return path


def test_builtins_and_user_tools_by_module_and_by_file(tmp_path):
    assert builtin_tool_names() == ["calculator", "python"]
    assert resolve_tool_class("calculator") is CalculatorTool
    assert resolve_tool_class("tests.rlcli.tools.user_tools:LookupTool") is user_tools.LookupTool
    by_file = resolve_tool_class(f"{USER_TOOLS}:LookupTool")
    assert by_file.__name__ == "LookupTool" and by_file.schema.name == "lookup"


def test_a_tool_config_with_renames_and_schemas(tmp_path):
    path = _write(
        tmp_path,
        [
            {"class": "calculator"},
            {"name": "calc2", "class": "calculator"},
            {"class": f"{USER_TOOLS}:LookupTool"},
            {
                "class": f"{USER_TOOLS}:NoSchemaTool",
                "schema": {
                    "type": "function",
                    "function": {
                        "name": "noschema",
                        "description": "d",
                        "parameters": {"type": "object", "properties": {}},
                    },
                },
            },
        ],
    )
    specs = load_tool_config(path)
    assert [s.name for s in specs] == ["calculator", "calc2", "lookup", "noschema"]
    assert (
        specs[1].schema.name == "calc2"
        and specs[1].schema.parameters == CalculatorTool.schema.parameters
    )
    tools = ToolSet(specs)
    assert [s["function"]["name"] for s in tools.openai_schemas()] == [s.name for s in specs]


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"class": "nope"}, "unknown tool class 'nope'; valid names: calculator, python"),
        ({"class": "no_such_module:Tool"}, "cannot import module 'no_such_module'"),
        ({"class": f"{USER_TOOLS}:Missing"}, "has no class 'Missing'"),
        ({"class": f"{USER_TOOLS}:NotATool"}, "is not a tool class: it must subclass"),
        ({"class": f"{USER_TOOLS}:MissingExecute"}, "does not implement execute"),
        ({"class": f"{USER_TOOLS}:NoSchemaTool"}, "has no default schema; give schema:"),
        ({"class": "calculator", "conf": {}}, "unknown keys \\['conf'\\]"),
        ({"name": "bad name!", "class": "calculator"}, "not a valid function name"),
        (
            {"class": "calculator", "schema": {"name": "c", "parameters": {"type": "array"}}},
            "parameters must be a schema of type 'object'",
        ),
        (
            {
                "class": "calculator",
                "schema": {
                    "name": "c",
                    "parameters": {"type": "object", "properties": {"x": {"type": 12}}},
                },
            },
            "not a valid JSON schema \\(at 'properties/x/type'\\)",
        ),
        (
            {
                "class": "calculator",
                "schema": {"name": "c", "parameters": {"type": "object", "required": "x"}},
            },
            "not a valid JSON schema",
        ),
    ],
)
def test_bad_entries_name_the_file_and_entry(tmp_path, entry, message):
    path = _write(tmp_path, [{"class": "calculator", "name": "first"}, entry])
    with pytest.raises(UserError, match=f"{path}: tools\\[1\\].*{message}"):
        load_tool_config(path)


def test_bad_files(tmp_path):
    with pytest.raises(UserError, match="tool config not found: .*absent.yaml"):
        load_tool_config(tmp_path / "absent.yaml")
    (tmp_path / "x.yaml").write_text("tools: [")
    with pytest.raises(UserError, match="invalid YAML in tool config"):
        load_tool_config(tmp_path / "x.yaml")
    (tmp_path / "x.yaml").write_text("- calculator")
    with pytest.raises(UserError, match="a mapping with one key, tools"):
        load_tool_config(tmp_path / "x.yaml")
    with pytest.raises(UserError, match="two tools are named 'calculator'"):
        load_tool_config(_write(tmp_path, ["calculator", {"class": "calculator"}]))


def test_lifecycle_create_from_row_kwargs_and_release_once(tmp_path):
    tools = ToolSet(load_tool_config(_write(tmp_path, ["tests.rlcli.tools.user_tools:LookupTool"])))
    user_tools.CREATED.clear()
    user_tools.RELEASED.clear()
    row_kwargs = {"lookup": {"create_kwargs": {"table": {"capital": "Paris"}}}}
    trajectory = tools.for_trajectory(row_kwargs)
    assert user_tools.CREATED == []  # created on first use
    assert trajectory.call("lookup", {"key": "capital"}).text == "Paris"
    assert trajectory.call("lookup", {"key": "moon"}).text == "no entry for moon"
    assert len(user_tools.CREATED) == 1 and user_tools.CREATED[0]["calls"] == 2
    assert trajectory.rewards == [1.0, 0.0]
    other = tools.for_trajectory(None)  # a row without tools_kwargs: empty create_kwargs
    assert other.call("lookup", {"key": "capital"}).text == "no entry for capital"
    trajectory.release()
    other.release()
    trajectory.release()  # a second release releases nothing again
    assert len(user_tools.RELEASED) == 2


def test_calls_that_cannot_run_are_rejected_with_texts(tmp_path):
    trajectory = ToolSet(load_tool_config(_write(tmp_path, ["calculator"]))).for_trajectory({})
    with pytest.raises(ToolCallRejected, match="unknown tool 'calc'; available tools: calculator"):
        trajectory.call("calc", {"expression": "1"})
    with pytest.raises(ToolCallRejected, match="'expression' is a required property"):
        trajectory.call("calculator", {})
    with pytest.raises(ToolCallRejected, match="Additional properties are not allowed"):
        trajectory.call("calculator", {"expression": "1", "x": 2})
    with pytest.raises(ToolCallRejected, match="3 is not of type 'string' \\(at 'expression'\\)"):
        trajectory.call("calculator", {"expression": 3})
    with pytest.raises(ToolCallRejected, match="must be a JSON object, got list"):
        trajectory.call("calculator", [1])


def test_bad_row_tools_kwargs_name_the_row(tmp_path):
    tools = ToolSet(load_tool_config(_write(tmp_path, ["calculator"])))
    with pytest.raises(
        UserError, match="data.jsonl:3: extra_info.tools_kwargs names tool 'search'"
    ):
        tools.for_trajectory({"search": {}}, "data.jsonl:3")
    with pytest.raises(UserError, match="tools_kwargs.calculator must be a mapping"):
        tools.for_trajectory({"calculator": {"create_kwargs": [1]}}, "row")


def test_schema_parsing_accepts_both_forms():
    inner = {"name": "f", "description": "d", "parameters": {"type": "object"}}
    assert parse_tool_schema(inner, "x") == parse_tool_schema(
        {"type": "function", "function": inner}, "x"
    )
    assert ToolSchema("f", "d").to_openai()["function"]["parameters"] == {"type": "object"}
