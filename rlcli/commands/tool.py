"""``rlcli tool call NAME 'ARGS_JSON' [--config tools.yaml]``: one tool call, exactly as a rollout
makes it (the same schema check, sandbox, limits, timeout and error texts). The response goes to
stdout (exit 0, an error text included); the call's status and latency to stderr. An unknown tool
or arguments that are not JSON exit 2."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from rlcli.config.agentic import MultiTurnConfig
from rlcli.errors import UserError

tool_app = typer.Typer(
    help="Try a tool by hand, exactly as a multi-turn rollout calls it.", no_args_is_help=True
)


@tool_app.command("call")
def tool_call(
    name: str = typer.Argument(..., help="The tool's name: a built-in, or one in --config."),
    arguments: str = typer.Argument(..., help="The arguments as a JSON object: '{\"a\": 1}'."),
    config: Optional[Path] = typer.Option(
        None, "--config", help="Tool config YAML (rollout.multi_turn.tool_config)."
    ),
    create_kwargs: str = typer.Option(
        "{}", "--create-kwargs", help="JSON: a row's extra_info.tools_kwargs.NAME.create_kwargs."
    ),
    timeout_s: float = typer.Option(
        MultiTurnConfig.tool_timeout_s,
        "--timeout",
        help="Per-call timeout in seconds (rollout.multi_turn.tool_timeout_s).",
    ),
):
    """Call tool NAME with ARGS_JSON and print its response."""
    from rlcli.tools.parsing import ToolCall
    from rlcli.tools.registry import builtin_tool_names
    from rlcli.tools.runner import ToolRunner
    from rlcli.tools.tool_config import ToolSet, load_tool_config, tool_spec

    parsed_arguments = _json_argument(arguments, "ARGS_JSON")
    parsed_create_kwargs = _json_argument(create_kwargs, "--create-kwargs")
    if config is not None:
        specs = {spec.name: spec for spec in load_tool_config(config)}
    elif name in builtin_tool_names():
        specs = {name: tool_spec(name, f"built-in tool {name}")}
    else:
        specs = {}
    if name not in specs:
        where = f"in {config}" if config is not None else "among the built-in tools"
        known = ", ".join(specs) if config is not None else ", ".join(builtin_tool_names())
        raise UserError(
            f"unknown tool {name!r} {where}; tools: {known} (user tools: --config tools.yaml)"
        )
    tools = ToolSet([specs[name]])  # only this one: calling calculator does not start a sandbox
    tools.check_timeout(timeout_s, "--timeout")
    trajectory = tools.for_trajectory(
        {name: {"create_kwargs": parsed_create_kwargs}}, "--create-kwargs"
    )
    runner = ToolRunner(timeout_s, max_calls_per_turn=1)
    try:
        [[outcome]] = runner.run_turn([(trajectory, [ToolCall(name, parsed_arguments)])])
    finally:
        trajectory.release()
        runner.close()
    typer.echo(outcome.text)
    typer.echo(f"[{outcome.status}, {outcome.latency_s:.3f} s]", err=True)


def _json_argument(text: str, what: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise UserError(
            f"{what} is not JSON: {error.msg} at character {error.pos}: {text!r}"
        ) from None
