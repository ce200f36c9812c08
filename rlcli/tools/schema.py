"""A tool's OpenAI function schema, checked with ``jsonschema``, and its arguments checked against it.

The schema is what the chat template shows the model (``tokenizer.apply_chat_template(...,
tools=[schema.to_openai(), ...])``) and what a call's arguments must satisfy before the tool runs.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import jsonschema
from jsonschema.exceptions import SchemaError, best_match

from rlcli.errors import UserError

# OpenAI's rule for function names; the names also appear verbatim in the model's tool calls.
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass(frozen=True)
class ToolSchema:
    """A function in OpenAI's format: ``name``, ``description`` and ``parameters``, a JSON schema
    of ``type: object`` describing the call's arguments."""

    name: str
    description: str
    parameters: Mapping[str, Any] = field(default_factory=lambda: {"type": "object"})

    def to_openai(self) -> dict[str, Any]:
        """``{"type": "function", "function": {...}}``, as chat templates take it in ``tools``."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": dict(self.parameters),
            },
        }

    def argument_error(self, arguments: Any) -> str | None:
        """Why ``arguments`` do not satisfy ``parameters`` (the most relevant error), or None."""
        validator = jsonschema.validators.validator_for(self.parameters)(self.parameters)
        error = best_match(validator.iter_errors(arguments))
        if error is None:
            return None
        where = "/".join(str(p) for p in error.absolute_path)
        return f"{error.message} (at '{where}')" if where else error.message


def parse_tool_schema(raw: Any, where: str) -> ToolSchema:
    """A ``ToolSchema`` from a mapping, either OpenAI's ``{"type": "function", "function": {name,
    description, parameters}}`` or the inner ``{name, description, parameters}``.

    ``where`` names the source in errors (``"tools.yaml: tools[0].schema"``). Raises ``UserError``
    when a key is missing or ``parameters`` is not a valid JSON schema of ``type: object``.
    """
    if not isinstance(raw, Mapping):
        raise UserError(f"{where}: a tool schema must be a mapping, got {type(raw).__name__}")
    if "function" in raw:
        if raw.get("type", "function") != "function":
            raise UserError(f"{where}: type must be 'function', got {raw.get('type')!r}")
        where, raw = f"{where}.function", raw["function"]
        if not isinstance(raw, Mapping):
            raise UserError(f"{where}: must be a mapping (name, description, parameters)")
    unknown = sorted(set(raw) - {"name", "description", "parameters", "strict"})
    if unknown:
        raise UserError(
            f"{where}: unknown keys {unknown}; a function schema has name, description, parameters"
        )
    name, description = raw.get("name"), raw.get("description", "")
    if not isinstance(name, str) or not _NAME.match(name):
        raise UserError(
            f"{where}.name: {name!r} is not a valid function name (1-64 letters, digits, _ or -)"
        )
    if not isinstance(description, str):
        raise UserError(f"{where}.description must be a string")
    parameters = raw.get("parameters", {"type": "object"})
    check_parameters_schema(parameters, f"{where}.parameters")
    return ToolSchema(name, description, parameters)


def check_parameters_schema(parameters: Any, where: str) -> None:
    """``UserError`` unless ``parameters`` is a valid JSON schema (its own ``$schema`` draft, or
    the newest one jsonschema knows) describing an object."""
    if not isinstance(parameters, Mapping):
        raise UserError(f"{where}: must be a JSON schema mapping, got {type(parameters).__name__}")
    try:
        jsonschema.validators.validator_for(parameters).check_schema(parameters)
    except SchemaError as error:
        path = "/".join(str(p) for p in error.absolute_path)
        at = f" (at '{path}')" if path else ""
        raise UserError(f"{where}: not a valid JSON schema{at}: {error.message}") from None
    if parameters.get("type") != "object":
        raise UserError(
            f"{where}: a function's parameters must be a schema of type 'object' (the call's "
            f"arguments are a JSON object), got type {parameters.get('type')!r}"
        )
