"""A user tool for docs/agentic.md: looks facts up in a table that each row brings along.

The row's ``extra_info.tools_kwargs.lookup.create_kwargs.facts`` is the trajectory's table, so
every prompt can come with its own facts; a found fact earns a tool reward of 1.
"""

from __future__ import annotations

from rlcli.tools.base import Tool, ToolResult
from rlcli.tools.schema import ToolSchema


class LookupTool(Tool):
    schema = ToolSchema(
        name="lookup",
        description="Look up a fact by its key.",
        parameters={
            "type": "object",
            "properties": {"key": {"type": "string", "description": "the fact's name"}},
            "required": ["key"],
        },
    )

    def create(self, create_kwargs):
        # Keys are matched without regard to case when the config says so.
        facts = dict(create_kwargs.get("facts", {}))
        if self.config.get("ignore_case", False):
            facts = {key.lower(): value for key, value in facts.items()}
        return facts

    def execute(self, state, arguments):
        key = (
            arguments["key"].lower() if self.config.get("ignore_case", False) else arguments["key"]
        )
        if key not in state:
            return ToolResult(f"no fact named {arguments['key']!r}", reward=0.0)
        return ToolResult(str(state[key]), reward=1.0)
