"""The YAML tool config, the tools of a run (``ToolSet``) and of one trajectory (``TrajectoryTools``).

Format (``rollout.multi_turn.tool_config``)::

    tools:
      - class: calculator              # built-in name, module:Class or path/file.py:Class
      - name: run_python               # the function name the model calls (default: the schema's)
        class: python
        config: {wall_time_s: 5}       # passed to the class's constructor
      - class: my_tools.py:LookupTool
        config: {table: data/facts.json}
        schema:                        # required when the class has none; else overrides it
          name: lookup
          description: Look up a fact by key.
          parameters: {type: object, properties: {key: {type: string}}, required: [key]}

``schema`` takes OpenAI's ``{type: function, function: {...}}`` or the inner mapping.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from rlcli.errors import UserError
from rlcli.tools.base import Tool, ToolResult
from rlcli.tools.registry import resolve_tool_class
from rlcli.tools.schema import ToolSchema, parse_tool_schema

ENTRY_KEYS = ("name", "class", "config", "schema")


@dataclass(frozen=True)
class ToolSpec:
    """One checked tool config entry (nothing built yet)."""

    name: str
    cls: type[Tool]
    config: dict[str, Any]
    schema: ToolSchema
    where: str  # names the file and entry in errors


def load_tool_config(path: str | Path) -> list[ToolSpec]:
    """Read and check a tool config: ``UserError`` naming the file and entry for an unknown tool
    class, a class that is not a ``Tool``, an invalid schema, or a duplicate name."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"tool config not found: {path} (rollout.multi_turn.tool_config)")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise UserError(f"invalid YAML in tool config {path}: {error}") from None
    if not isinstance(raw, Mapping) or set(raw) != {"tools"} or not isinstance(raw["tools"], list):
        raise UserError(f"{path}: a tool config is a mapping with one key, tools: a list of tools")
    if not raw["tools"]:
        raise UserError(f"{path}: tools is empty")
    specs = [tool_spec(entry, f"{path}: tools[{i}]") for i, entry in enumerate(raw["tools"])]
    names = [spec.name for spec in specs]
    for name in names:
        if names.count(name) > 1:
            raise UserError(f"{path}: two tools are named {name!r}; give one a different name")
    return specs


def tool_spec(entry: Any, where: str) -> ToolSpec:
    """One entry (a mapping with ``class`` and optional ``name``, ``config``, ``schema``)."""
    if isinstance(entry, str):  # a bare class, e.g. `- calculator`
        entry = {"class": entry}
    if not isinstance(entry, Mapping) or not isinstance(entry.get("class"), str):
        raise UserError(f"{where}: each tool needs a class (e.g. class: calculator)")
    unknown = sorted(set(entry) - set(ENTRY_KEYS))
    if unknown:
        raise UserError(f"{where}: unknown keys {unknown}; a tool has {', '.join(ENTRY_KEYS)}")
    cls = resolve_tool_class(entry["class"], where)
    config = entry.get("config") or {}
    if not isinstance(config, Mapping):
        raise UserError(f"{where}.config must be a mapping, got {type(config).__name__}")
    if "schema" in entry:
        schema = parse_tool_schema(entry["schema"], f"{where}.schema")
    elif isinstance(getattr(cls, "schema", None), ToolSchema):
        schema = cls.schema
    else:
        raise UserError(f"{where}: {entry['class']} has no default schema; give schema:")
    name = entry.get("name", schema.name)
    if name != schema.name:
        schema = parse_tool_schema(
            {**schema.to_openai()["function"], "name": name}, f"{where}.name"
        )
    return ToolSpec(name, cls, dict(config), schema, f"{where} ({name})")


class ToolSet:
    """The built tools of a run, by the name the model calls them."""

    def __init__(self, specs: list[ToolSpec]) -> None:
        self.tools: dict[str, Tool] = {}
        self.schemas: dict[str, ToolSchema] = {}
        for spec in specs:
            try:
                tool = spec.cls(spec.config)
            except UserError as error:
                raise UserError(f"{spec.where}: {error}") from None
            except Exception as error:
                raise UserError(
                    f"{spec.where}: {spec.cls.__name__}({spec.config}) failed: "
                    f"{type(error).__name__}: {error}"
                ) from error
            self.tools[spec.name] = tool
            self.schemas[spec.name] = spec.schema
        self._where = {spec.name: spec.where for spec in specs}

    def openai_schemas(self) -> list[dict[str, Any]]:
        """The functions in OpenAI's format, for ``apply_chat_template(..., tools=...)``."""
        return [schema.to_openai() for schema in self.schemas.values()]

    def check_timeout(self, timeout_s: float, key: str) -> None:
        """``UserError`` when a tool's own time limit is not below the per-call timeout ``key``:
        the runner would stop waiting while the tool still runs."""
        for name, tool in self.tools.items():
            limit = tool.time_limit_s
            if limit is not None and limit >= timeout_s:
                raise UserError(
                    f"{self._where[name]}: its calls may take up to {limit:g} s, not less than "
                    f"{key}={timeout_s:g}; raise {key} or lower the tool's limit"
                )

    def for_trajectory(self, tools_kwargs: Any, where: str = "row") -> TrajectoryTools:
        """The tools of one trajectory; ``tools_kwargs`` is the row's ``extra_info.tools_kwargs``
        (``{tool name: {"create_kwargs": {...}}}``, verl's schema), or None."""
        return TrajectoryTools(self, tools_kwargs or {}, where)


class ToolCallRejected(Exception):
    """A call that cannot run (unknown tool, arguments that do not fit the schema); the message
    is the tool response the model gets."""


class TrajectoryTools:
    """One trajectory's tool states: created on a tool's first call, released together."""

    def __init__(self, toolset: ToolSet, tools_kwargs: Any, where: str) -> None:
        if not isinstance(tools_kwargs, Mapping):
            raise UserError(f"{where}: extra_info.tools_kwargs must be a mapping of tool names")
        for name, kwargs in tools_kwargs.items():
            if name not in toolset.tools:
                raise UserError(
                    f"{where}: extra_info.tools_kwargs names tool {name!r}, which the tool config "
                    f"does not have (tools: {', '.join(toolset.tools)})"
                )
            create = kwargs.get("create_kwargs", {}) if isinstance(kwargs, Mapping) else None
            if not isinstance(create, Mapping):
                raise UserError(
                    f"{where}: extra_info.tools_kwargs.{name} must be a mapping with an optional "
                    "create_kwargs mapping"
                )
        self.toolset = toolset
        self.tools_kwargs = tools_kwargs
        self.rewards: list[float] = []
        self._states: dict[str, Any] = {}
        self._lock = threading.Lock()

    def call(self, name: str, arguments: Any) -> ToolResult:
        """Run one call; ``ToolCallRejected`` for an unknown tool or arguments that do not fit."""
        tool = self.toolset.tools.get(name)
        if tool is None:
            raise ToolCallRejected(
                f"Error: unknown tool {name!r}; available tools: {', '.join(self.toolset.tools)}"
            )
        if not isinstance(arguments, dict):
            raise ToolCallRejected(
                f"Error: the arguments of {name} must be a JSON object, got {type(arguments).__name__}"
            )
        problem = self.toolset.schemas[name].argument_error(arguments)
        if problem is not None:
            raise ToolCallRejected(f"Error: invalid arguments for {name}: {problem}")
        result = tool.execute(self._state(name, tool), arguments)
        if not isinstance(result, ToolResult):
            raise TypeError(f"{type(tool).__name__}.execute returned {type(result).__name__}")
        if result.reward is not None:
            with self._lock:
                self.rewards.append(float(result.reward))
        return dataclasses.replace(result, metrics=dict(result.metrics))

    def _state(self, name: str, tool: Tool) -> Any:
        with self._lock:
            if name not in self._states:
                kwargs = self.tools_kwargs.get(name) or {}
                self._states[name] = tool.create(kwargs.get("create_kwargs", {}))
            return self._states[name]

    def release(self) -> None:
        """Release every state this trajectory created (each tool once)."""
        with self._lock:
            states, self._states = self._states, {}
        for name, state in states.items():
            self.toolset.tools[name].release(state)
