"""The tool interface: one ``Tool`` object per tool of a run, one state per trajectory.

Lifecycle, per trajectory (verl's tool schema)::

    state = tool.create(create_kwargs)   # the row's extra_info.tools_kwargs.<name>.create_kwargs
    result = tool.execute(state, arguments)   # any number of calls; arguments match the schema
    tool.release(state)                   # the trajectory is finished

``execute`` may run in several threads at once (one per concurrent call, with different states)
and must be safe for that. A user tool subclasses ``Tool`` and is named in the tool config as
``module:Class`` or ``path/file.py:Class``; its constructor takes the entry's ``config`` mapping.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from rlcli.tools.schema import ToolSchema


@dataclass
class ToolResult:
    """What one call returns: ``text`` becomes the tool message the model reads next; ``reward``
    (optional) is added to the trajectory's tool rewards; ``metrics`` are averaged per tool."""

    text: str
    reward: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)


class Tool(ABC):
    """Base class of every tool. ``schema`` is the default function schema (a tool config entry may
    override it); ``time_limit_s`` is the longest a call may take by the tool's own limits, when it
    enforces one (the rollout's per-call timeout must be longer)."""

    schema: ClassVar[ToolSchema]

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        self.config: dict[str, Any] = dict(config or {})

    @property
    def time_limit_s(self) -> float | None:
        return None

    def create(self, create_kwargs: Mapping[str, Any]) -> Any:
        """Per-trajectory state, from the row's ``create_kwargs`` (default: those kwargs)."""
        return dict(create_kwargs)

    @abstractmethod
    def execute(self, state: Any, arguments: dict[str, Any]) -> ToolResult:
        """Run one call. ``arguments`` already satisfy the schema's ``parameters``. A problem the
        model caused (a bad expression, code that raises) is reported in ``ToolResult.text``."""

    def release(self, state: Any) -> None:
        """Free what ``create`` made; called once per trajectory that used the tool."""
        return None
