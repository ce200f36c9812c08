"""What a rollout call's agents did, counted (``rlcli.rollout.agents.runner``): summed over
replicas by the sampler, reported as ``agent/*`` metrics, and held to
``rollout.agent_options.max_failure_rate``."""

from __future__ import annotations

from dataclasses import dataclass, fields

from rlcli.errors import UserError


@dataclass
class AgentStats:
    """A rollout call's agent counts (summed over replicas); ``metrics`` reports them."""

    agents: int = 0
    failed: int = 0
    errors: int = 0
    timeouts: int = 0
    bad_returns: int = 0
    no_calls: int = 0  # returned without calling the model: nothing to train on
    calls: int = 0
    samples: int = 0
    splits: int = 0  # segments beyond the first, over all trajectories
    split_trajectories: int = 0
    dropped_samples: int = 0
    unknown_model: int = 0
    bad_requests: int = 0
    sampling_overridden: int = 0
    reused_prompts: int = 0  # prompts built on kept token ids
    rendered_prompts: int = 0  # prompts rendered whole from the messages
    seconds: float = 0.0  # summed over agents
    first_error: str | None = None

    def add(self, other: AgentStats) -> None:
        for f in fields(self):
            if f.name != "first_error":
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        self.first_error = self.first_error or other.first_error

    def metrics(self, prefix: str = "") -> dict[str, float]:
        count = max(self.agents, 1)
        values = {
            "agent/count": float(self.agents),
            "agent/failure_rate": self.failed / count,
            "agent/errors": float(self.errors),
            "agent/timeouts": float(self.timeouts),
            "agent/bad_returns": float(self.bad_returns),
            "agent/no_calls": float(self.no_calls),
            "agent/calls_mean": self.calls / count,
            "agent/samples": float(self.samples),
            "agent/splits": float(self.splits),
            "agent/split_rate": self.split_trajectories / count,
            "agent/dropped_samples": float(self.dropped_samples),
            "agent/unknown_model": float(self.unknown_model),
            "agent/bad_requests": float(self.bad_requests),
            "agent/sampling_overridden": float(self.sampling_overridden),
            "agent/reused_prompt_rate": self.reused_prompts
            / max(self.reused_prompts + self.rendered_prompts, 1),
            "agent/seconds_mean": self.seconds / count,
        }
        return {f"{prefix}{key}": value for key, value in values.items()}

    def check(self, max_failure_rate: float) -> None:
        """``UserError`` with the first failure when too many agents failed."""
        if self.agents and self.failed / self.agents > max_failure_rate:
            raise UserError(
                f"{self.failed} of {self.agents} agents failed, more than "
                f"rollout.agent_options.max_failure_rate={max_failure_rate}; first error: "
                f"{self.first_error}. Fix the agent (rollout.agent), raise "
                "rollout.agent_options.timeout_s, or raise max_failure_rate."
            )
