"""Exact token capture: the calls an agent made, joined into training samples.

The server records every completion it returns as a ``CapturedCall``: the prompt token ids it
built, the sampled token ids and their log-probs, exactly as the engine gave them. A trajectory's
calls become samples here, never by decoding and re-encoding text:

- a call whose prompt *extends* an open segment (that segment's prompt + everything after it so
  far, token for token) continues it: the new prompt tokens are appended with loss mask 0 (tool
  results, the agent's own messages, the chat template's turn headers), the sampled tokens with
  loss mask 1 and the engine's log-probs;
- any other call starts a new segment (a *split*: the agent edited, re-ordered or summarised its
  history, or the chat template renders it otherwise). Each segment is its own training sample,
  so every trained token is one the engine sampled after exactly the tokens before it.

When several open segments could continue, the longest wins (the call carries on the most
context); with ``n > 1`` each choice is its own call with the same prompt, so only one of them
can be continued by the next call and the others end as segments of their own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class CapturedCall:
    """One completion the endpoint returned: what the engine saw and sampled."""

    prompt_ids: list[int]
    completion_ids: list[int]
    log_probs: list[float]  # the engine's, per completion token
    finish_reason: str  # stop | length


@dataclass
class Segment:
    """Calls joined token for token: one training sample."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    calls: int = 0
    finish_reason: str = "stop"  # the last call's

    @property
    def full_ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def extended_by(self, prompt_ids: Sequence[int]) -> bool:
        """Whether ``prompt_ids`` starts with everything this segment holds."""
        size = len(self.prompt_ids) + len(self.response_ids)
        return len(prompt_ids) >= size and list(prompt_ids[:size]) == self.full_ids

    def append(self, call: CapturedCall) -> None:
        """``call`` after what this segment holds: its new prompt tokens (mask 0), then its
        sampled tokens (mask 1, the engine's log-probs)."""
        between = list(call.prompt_ids[len(self.prompt_ids) + len(self.response_ids) :])
        self.response_ids += between + list(call.completion_ids)
        self.loss_mask += [0] * len(between) + [1] * len(call.completion_ids)
        self.log_probs += [0.0] * len(between) + list(call.log_probs)
        self.calls += 1
        self.finish_reason = call.finish_reason


def join_calls(calls: Sequence[CapturedCall]) -> list[Segment]:
    """A trajectory's calls (in the order they were answered) as segments (module docstring)."""
    segments: list[Segment] = []
    for call in calls:
        open_ = [s for s in segments if s.extended_by(call.prompt_ids)]
        if open_:
            max(open_, key=lambda s: len(s.prompt_ids) + len(s.response_ids)).append(call)
        else:
            segment = Segment(prompt_ids=list(call.prompt_ids))
            segment.append(call)
            segments.append(segment)
    return segments
