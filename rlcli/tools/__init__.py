"""Tools a policy calls during a multi-turn rollout, and the pieces a rollout needs around them.

- ``rlcli.tools.base``: the tool interface (``Tool``: create -> execute -> ``ToolResult`` ->
  release) and its OpenAI function schema (``ToolSchema``).
- ``rlcli.tools.registry``: built-in tools by name, user tools as ``module:Class`` or
  ``path/file.py:Class``.
- ``rlcli.tools.tool_config``: the YAML tool config, the tools of a run (``ToolSet``) and of one
  trajectory (``TrajectoryTools``).
- ``rlcli.tools.calculator``, ``rlcli.tools.python_tool`` (over ``rlcli.tools.sandbox``): the
  built-in ``calculator`` and ``python`` tools.
- ``rlcli.tools.parsing``: tool calls in the model's text, by format (``hermes``).
- ``rlcli.tools.runner``: one turn's tool calls run concurrently, with timeouts and metrics.
- ``rlcli.tools.rendering``: a tool / environment message as the token ids the chat template
  appends (token-in/token-out).
- ``rlcli.tools.multi_turn``: all of the above built from ``rollout.multi_turn``.

This package file imports nothing, so the sandbox (standard library only) loads on any Python.
"""
