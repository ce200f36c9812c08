"""Tool classes by name: the built-ins, and user tools as ``module:Class`` or ``path/file.py:Class``.

Built-ins are listed by module path and imported on first use, so naming one tool does not import
the others (the ``python`` tool's sandbox probe, for instance).
"""

from __future__ import annotations

from algorithms.registry import Registry
from rlcli.errors import UserError
from rlcli.plugins import is_user_spec, load_user_object, load_user_subclass
from rlcli.tools.base import Tool

# name -> where the class lives, imported on first use
BUILTIN_TOOLS: Registry[str] = Registry(
    "tool class", error=UserError, alternatives=", or 'module:Class', or 'path/to/file.py:Class'"
)
BUILTIN_TOOLS["calculator"] = "rlcli.tools.calculator:CalculatorTool"
BUILTIN_TOOLS["python"] = "rlcli.tools.python_tool:PythonTool"


def builtin_tool_names() -> list[str]:
    """Names accepted as a tool class without a module path, sorted."""
    return BUILTIN_TOOLS.names()


def resolve_tool_class(spec: str, where: str = "tool") -> type[Tool]:
    """The ``Tool`` subclass a built-in name, ``module:Class`` or ``path/file.py:Class`` names.

    ``where`` prefixes errors (the tool config file and entry). Raises ``UserError`` for an unknown
    name, an import failure, or a class that does not implement the tool interface.
    """
    if spec in BUILTIN_TOOLS:
        cls, _ = load_user_object(BUILTIN_TOOLS[spec], "tool", "class")
        return cls
    if not is_user_spec(spec):
        raise UserError(f"{where}: {BUILTIN_TOOLS.unknown(spec)}")
    return load_user_subclass(spec, Tool, "a tool", where, "create / execute / release")
