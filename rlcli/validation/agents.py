"""``rollout.agent``: an agent written against the OpenAI API (docs/agentic.md), checked before
anything starts."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlcli.errors import UserError

if TYPE_CHECKING:
    from rlcli.config.schema import RLConfig


def check_agent(cfg: RLConfig) -> None:
    """The agent importable and callable; its options in range; nothing else driving the turns."""
    rollout = cfg.rollout
    if rollout.agent is None:
        return
    from rlcli.rollout.agents.runner import load_agent

    load_agent(rollout.agent)
    if rollout.multi_turn.enable or rollout.multi_turn.tool_config is not None:
        raise UserError(
            "rollout.agent runs its own turns and tools through the OpenAI API; it cannot be "
            "combined with rollout.multi_turn (enable / tool_config): drop one of the two"
        )
    options = rollout.agent_options
    for key in ("concurrency", "max_response_tokens"):
        if getattr(options, key) < 1:
            raise UserError(
                f"rollout.agent_options.{key} must be >= 1, got {getattr(options, key)}"
            )
    if not options.timeout_s > 0:
        raise UserError(f"rollout.agent_options.timeout_s must be > 0, got {options.timeout_s}")
    if not 0.0 <= options.max_failure_rate <= 1.0:
        raise UserError(
            "rollout.agent_options.max_failure_rate must be in [0, 1], got "
            f"{options.max_failure_rate}"
        )
    if not options.model_name:
        raise UserError("rollout.agent_options.model_name must not be empty")
    if cfg.data.apply_chat_template is False:
        raise UserError(
            "rollout.agent renders the agents' messages with the chat template: set "
            "data.apply_chat_template to null (auto) or true"
        )
    if cfg.rm.on_policy_samples:
        raise UserError(
            "rm.on_policy_samples grades single prompts' answers; with rollout.agent set it to 0"
        )
    if rollout.max_model_len is not None:
        need = cfg.data.max_prompt_length + options.max_response_tokens
        if rollout.max_model_len < need:
            raise UserError(
                f"rollout.max_model_len={rollout.max_model_len} is shorter than "
                f"data.max_prompt_length + rollout.agent_options.max_response_tokens = {need}"
            )
