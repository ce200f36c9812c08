"""What a multi-turn trajectory did besides its token ids.

A multi-turn ``Sample`` carries a ``TrajectoryRecord`` (``Sample.trajectory``): the reward reads
it (the generated text as ``solution_str``; the message list, tool rewards and counts in
``extra_info``), and the step's ``multi_turn/*`` / ``tool/*`` metrics summarise the records.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from rlcli.tools.runner import ToolCallOutcome

if TYPE_CHECKING:
    from rlcli.config.schema import RLConfig

BudgetCut = Literal["max_assistant_turns", "max_response_tokens"]


@dataclass
class AgentRecord:
    """What an agent's trajectory adds: its own reward, and which of its segments (one sample
    each: ``rlcli.rollout.agents.capture``) a sample is."""

    session: str  # the trajectory's id (shared by its segments)
    reward: float | None  # what the agent returned (None: the run's reward function scores it)
    segment: int = 0
    segments: int = 1
    calls: int = 0  # model calls in the whole trajectory


@dataclass
class TrajectoryRecord:
    """One trajectory's turns as the reward and the metrics see them."""

    messages: list[dict[str, Any]]  # the prompt's messages, then every turn's, in order
    solution_str: str  # the generated tokens of all turns, decoded (special tokens removed)
    assistant_turns: int
    tool_calls: list[ToolCallOutcome] = field(default_factory=list)  # every call, in order
    tool_rewards: list[float] = field(default_factory=list)  # rewards the tools gave
    environment_reward: float | None = None  # the environment's last reward, when it gave one
    cut_by: BudgetCut | None = None  # the budget that ended it (None: it finished)
    agent: AgentRecord | None = None  # an OpenAI-API agent's trajectory (rollout.agent)

    def reward_extra_info(self, row_extra_info: dict[str, Any] | None) -> dict[str, Any]:
        """The reward's ``extra_info``: the row's, plus the trajectory's ``messages``,
        ``num_turns`` (assistant turns), ``num_tool_calls``, ``tool_rewards``,
        ``environment_reward`` and ``cut_by``."""
        return {
            **(row_extra_info or {}),
            "messages": self.messages,
            "num_turns": self.assistant_turns,
            "num_tool_calls": len(self.tool_calls),
            "tool_rewards": list(self.tool_rewards),
            "environment_reward": self.environment_reward,
            "cut_by": self.cut_by,
            **({"agent_reward": self.agent.reward} if self.agent is not None else {}),
        }


def response_limit(cfg: RLConfig) -> int:
    """The longest response of a run: ``rollout.max_tokens``, or with multi-turn rollouts a
    trajectory's budget (``rollout.multi_turn.max_response_tokens``). Also the constant length
    ``seq-mean-token-sum-norm`` divides by."""
    if cfg.rollout.agent is not None:
        return cfg.rollout.agent_options.max_response_tokens
    multi_turn = cfg.rollout.multi_turn
    return multi_turn.max_response_tokens if multi_turn.enable else cfg.rollout.max_tokens
