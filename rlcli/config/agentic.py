"""The config of rollouts that run over several turns (``rollout.multi_turn.*``: the model calls
tools or talks to an environment) and of agents written against the OpenAI API
(``rollout.agent_options.*``), in a module of their own beside ``rlcli.config.schema``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional


@dataclass
class MultiTurnConfig:
    """Multi-turn rollouts: the model calls tools or talks to an environment over several turns
    (docs/agentic.md). Each assistant turn generates up to ``rollout.max_tokens`` tokens."""

    enable: bool = False  # multi-turn rollouts (false: one prompt, one completion)
    max_assistant_turns: int = 4  # assistant turns per trajectory
    max_tool_calls_per_turn: int = 4  # calls run per turn; each further one gets an error response
    max_tool_response_tokens: int = 256  # a longer tool response is cut to this (marker included)
    # which part of a long tool response is cut away
    tool_response_truncate_side: Literal["left", "right", "middle"] = "middle"
    # tokens after the prompt per trajectory: generated turns plus tool / environment messages
    max_response_tokens: int = 1024
    format: Literal["hermes"] = "hermes"  # how the model writes tool calls (hermes: Qwen2.5's tags)
    tool_config: Optional[str] = None  # YAML file of the tools (docs/agentic.md); None: no tools
    tool_timeout_s: float = 30.0  # per tool call; a call past it answers with a timeout error
    # built-in name (running_sum), module:Class or path/file.py:Class; None: no environment
    environment: Optional[str] = None
    environment_kwargs: dict[str, Any] = field(default_factory=dict)  # the environment's config


@dataclass
class AgentOptions:
    """Agents written against the OpenAI API (``rollout.agent``; docs/agentic.md): how many run
    at once, how long each may take, and what a failing one costs."""

    concurrency: int = 64  # agents running at once per rollout replica
    timeout_s: float = 300.0  # per agent call; past it the agent fails (timeout)
    # what a failed agent (raised, timed out, returned something other than a number or None)
    # leaves: drop (its samples are not trained on) | zero (its captured calls, score 0)
    on_failure: Literal["drop", "zero"] = "drop"
    # the share of a step's agents that may fail before the run stops with the first error
    max_failure_rate: float = 0.5
    # tokens a trajectory may add after its first prompt (sampled and appended); a call past
    # it gets an HTTP 400 error the agent should end its episode on
    max_response_tokens: int = 1024
    host: str = "127.0.0.1"  # where the endpoint listens (loopback unless set otherwise)
    model_name: str = "policy"  # the model name agents pass (any other is a 404)
    kwargs: dict[str, Any] = field(default_factory=dict)  # extra keyword arguments to the agent
