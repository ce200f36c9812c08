"""The environment interface and its registry.

Lifecycle, per trajectory (verl's interaction schema)::

    state = env.start(interaction_kwargs)      # the row's extra_info.interaction_kwargs
    response = env.respond(state, assistant_text)   # after every assistant turn, until done
    env.release(state)

``respond`` may run in several threads at once (different states) and must be safe for that.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from algorithms.registry import Registry
from rlcli.errors import UserError
from rlcli.plugins import is_user_spec, load_user_object, load_user_subclass

# name -> where the class lives, imported on first use
BUILTIN_ENVIRONMENTS: Registry[str] = Registry(
    "environment", error=UserError, alternatives=", or 'module:Class', or 'file.py:Class'"
)
BUILTIN_ENVIRONMENTS["running_sum"] = "rlcli.environments.running_sum:RunningSumEnvironment"


@dataclass
class EnvironmentResponse:
    """The environment's answer to one assistant turn: ``text`` is the next user message (unused
    when ``done``); ``reward`` (optional) scores the trajectory so far."""

    text: str
    done: bool
    reward: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)


class Environment(ABC):
    """Base class of every environment; the constructor takes ``rollout.multi_turn
    .environment_kwargs``."""

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        self.config: dict[str, Any] = dict(config or {})

    def start(self, interaction_kwargs: Mapping[str, Any]) -> Any:
        """Per-trajectory state from the row's ``interaction_kwargs`` (default: those kwargs)."""
        return dict(interaction_kwargs)

    @abstractmethod
    def respond(self, state: Any, assistant_text: str) -> EnvironmentResponse:
        """Answer the assistant's latest turn (its decoded text, special tokens removed)."""

    def release(self, state: Any) -> None:
        """Free what ``start`` made."""
        return None


def resolve_environment_class(spec: str, key: str = "rollout.multi_turn.environment") -> type:
    """The ``Environment`` subclass a built-in name, ``module:Class`` or ``path/file.py:Class``
    names; ``UserError`` naming ``key`` otherwise."""
    if spec in BUILTIN_ENVIRONMENTS:
        cls, _ = load_user_object(BUILTIN_ENVIRONMENTS[spec], "environment", "class")
        return cls
    if not is_user_spec(spec):
        raise UserError(BUILTIN_ENVIRONMENTS.unknown(spec, key))
    return load_user_subclass(spec, Environment, "an environment", key, "start / respond / release")
