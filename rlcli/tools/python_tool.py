"""The built-in ``python`` tool: ``{"code": "..."}`` runs in ``rlcli.tools.sandbox``; the response is
the code's stdout and stderr, followed by a bracketed note when the run did not end normally."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from rlcli.errors import UserError
from rlcli.tools.base import Tool, ToolResult
from rlcli.tools.sandbox import PythonSandbox, SandboxLimits
from rlcli.tools.schema import ToolSchema

_LIMIT_KEYS = {f.name: f.type for f in fields(SandboxLimits)}
CONFIG_KEYS = sorted([*_LIMIT_KEYS, "interpreter", "workdir_root", "read_only_paths"])
NO_OUTPUT = "(no output)"


class PythonTool(Tool):
    """``python``. Config keys: the ``SandboxLimits`` fields (``wall_time_s``, ``cpu_time_s``,
    ``memory_mb``, ``max_processes``, ``max_output_bytes``, ``max_file_mb``, ``max_open_files``),
    ``interpreter`` (default: this Python), ``workdir_root`` (where working directories are
    made; default: the system's temporary directory) and ``read_only_paths`` (host paths the code
    may read, e.g. a package installed outside the interpreter; default: none)."""

    schema = ToolSchema(
        name="python",
        description=(
            "Run a Python program in a sandbox (no network, no files kept between calls) and "
            "return what it prints to stdout and stderr. Use print() to see values."
        ),
        parameters={
            "type": "object",
            "properties": {"code": {"type": "string", "description": "a complete Python program"}},
            "required": ["code"],
            "additionalProperties": False,
        },
    )

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        super().__init__(config)
        unknown = sorted(set(self.config) - set(CONFIG_KEYS))
        if unknown:
            raise UserError(f"unknown config keys {unknown}; valid: {', '.join(CONFIG_KEYS)}")
        limits = {}
        for key in _LIMIT_KEYS:
            if key in self.config:
                value = self.config[key]
                if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                    raise UserError(f"config.{key} must be a positive number, got {value!r}")
                limits[key] = int(value) if _LIMIT_KEYS[key] == "int" else float(value)
        self.sandbox = PythonSandbox(
            SandboxLimits(**limits),
            interpreter=self.config.get("interpreter"),
            workdir_root=self.config.get("workdir_root"),
            read_only_paths=self.config.get("read_only_paths", []),
        )

    @property
    def time_limit_s(self) -> float:
        # The wall limit plus the sandbox's start and clean-up (tens of milliseconds measured).
        return self.sandbox.limits.wall_time_s + 1.0

    def execute(self, state: Any, arguments: dict[str, Any]) -> ToolResult:
        result = self.sandbox.run(arguments["code"])
        notes = result.notes(self.sandbox.limits)
        text = result.output
        if notes:
            text += ("" if not text or text.endswith("\n") else "\n") + "".join(
                f"[{note}]" for note in notes
            )
        return ToolResult(
            text or NO_OUTPUT,
            metrics={
                "timed_out": float(result.timed_out),
                "output_truncated": float(result.output_truncated),
                "failed": float(bool(notes)),
                "wall_s": result.wall_s,
            },
        )
