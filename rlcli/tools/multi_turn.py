"""Everything a multi-turn rollout needs, built from ``rollout.multi_turn`` and the tokenizer.

The rollout loop owns the trajectories; per assistant turn it calls, for each live trajectory::

    parsed = components.parse_tool_calls(decoded_turn_text)
    # tools: components.runner.run_turn([(trajectory_tools, parsed.calls), ...]) for all at once
    messages = components.tool_messages(outcomes)   # or, with an environment's response:
    messages = [{"role": "user", "content": response.text}]
    ids = components.renderer.append_ids(generated_ids, messages)

and appends ``ids`` (loss mask 0) to the trajectory's token ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlcli.environments.base import Environment, resolve_environment_class
from rlcli.errors import UserError
from rlcli.tools.parsing import ToolCallParser, get_tool_call_parser
from rlcli.tools.rendering import MessageRenderer, TruncateSide, tool_message
from rlcli.tools.runner import ToolCallOutcome, ToolRunner
from rlcli.tools.tool_config import ToolSet, load_tool_config

if TYPE_CHECKING:
    from rlcli.config.agentic import MultiTurnConfig


@dataclass(frozen=True)
class TurnBudget:
    """How far one trajectory may go: assistant turns, and tokens after its prompt."""

    max_assistant_turns: int
    max_response_tokens: int

    def may_continue(self, assistant_turns: int, response_tokens: int) -> bool:
        """Whether another assistant turn may start after ``assistant_turns`` turns and
        ``response_tokens`` tokens (generated and appended) after the prompt."""
        return assistant_turns < self.max_assistant_turns and (
            response_tokens < self.max_response_tokens
        )

    def generation_limit(self, response_tokens: int, max_tokens: int) -> int:
        """``max_tokens`` for the next engine call: ``rollout.max_tokens`` within what is left."""
        return max(0, min(max_tokens, self.max_response_tokens - response_tokens))


@dataclass
class MultiTurnComponents:
    """The pieces of a multi-turn rollout; ``tools`` / ``runner`` or ``environment`` may be None."""

    tools: ToolSet | None
    runner: ToolRunner | None
    environment: Environment | None
    parse_tool_calls: ToolCallParser
    renderer: MessageRenderer
    budget: TurnBudget
    max_tool_response_tokens: int
    truncate_side: TruncateSide

    def tool_messages(self, outcomes: Sequence[ToolCallOutcome]) -> list[dict[str, Any]]:
        """The ``tool`` messages of a turn's calls, each response cut to
        ``max_tool_response_tokens``."""
        return [
            tool_message(
                o.name,
                self.renderer.truncate(o.text, self.max_tool_response_tokens, self.truncate_side),
            )
            for o in outcomes
        ]

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()


def prompt_tools(multi_turn: MultiTurnConfig) -> list[dict[str, Any]] | None:
    """The OpenAI function schemas a multi-turn run's prompts show (None without tools): the
    same list, in the same order, as ``ToolSet.openai_schemas`` of the built tools."""
    if not multi_turn.enable or multi_turn.tool_config is None:
        return None
    return [spec.schema.to_openai() for spec in load_tool_config(multi_turn.tool_config)]


def build_tools(multi_turn: MultiTurnConfig) -> ToolSet | None:
    """The tools of ``multi_turn.tool_config`` (None without one), built and checked against
    ``multi_turn.tool_timeout_s``."""
    if multi_turn.tool_config is None:
        return None
    tools = ToolSet(load_tool_config(multi_turn.tool_config))
    tools.check_timeout(multi_turn.tool_timeout_s, "rollout.multi_turn.tool_timeout_s")
    return tools


def build_environment(multi_turn: MultiTurnConfig) -> Environment | None:
    """``multi_turn.environment`` built with ``multi_turn.environment_kwargs`` (None without one)."""
    if multi_turn.environment is None:
        return None
    cls = resolve_environment_class(multi_turn.environment)
    try:
        return cls(dict(multi_turn.environment_kwargs))
    except UserError as error:
        raise UserError(
            f"rollout.multi_turn.environment={multi_turn.environment}: {error}"
        ) from None


def build_multi_turn(
    multi_turn: MultiTurnConfig, tokenizer: Any, tokenizer_setting: str = "model.tokenizer_path"
) -> MultiTurnComponents | None:
    """None when ``multi_turn.enable`` is false; else the components, or ``UserError`` (no chat
    template on the tokenizer named by ``tokenizer_setting``, a tool that cannot be built)."""
    if not multi_turn.enable:
        return None
    tools = build_tools(multi_turn)
    renderer = MessageRenderer(
        tokenizer, tools.openai_schemas() if tools else None, tokenizer_setting
    )
    runner = None
    if tools is not None:
        runner = ToolRunner(multi_turn.tool_timeout_s, multi_turn.max_tool_calls_per_turn)
    return MultiTurnComponents(
        tools=tools,
        runner=runner,
        environment=build_environment(multi_turn),
        parse_tool_calls=get_tool_call_parser(multi_turn.format),
        renderer=renderer,
        budget=TurnBudget(multi_turn.max_assistant_turns, multi_turn.max_response_tokens),
        max_tool_response_tokens=multi_turn.max_tool_response_tokens,
        truncate_side=multi_turn.tool_response_truncate_side,
    )
