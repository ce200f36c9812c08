"""One turn's tool calls, across all trajectories, run concurrently with a timeout per call.

Each call runs in its own thread, taken from a bounded pool only for as long as the call is
waited for: a call past its timeout answers the model with a timeout text and frees its pool
worker at once, so a slow tool delays nobody else. (Python cannot stop a thread: an in-process
tool that never returns keeps its own thread; the ``python`` tool's process has its own wall
limit, shorter than the timeout, and is killed by it.)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

from rlcli.tools.parsing import MalformedToolCall, ToolCall
from rlcli.tools.tool_config import ToolCallRejected, TrajectoryTools

CallStatus = Literal["ok", "error", "timeout", "skipped"]


@dataclass
class ToolCallOutcome:
    """One call as the model and the metrics see it. ``status``: ``ok`` (the tool answered, its
    text may still report the model's mistake, e.g. code that raised), ``error`` (malformed call,
    unknown tool, bad arguments, the tool raised), ``timeout``, ``skipped`` (over the per-turn
    limit)."""

    name: str | None  # None when the call could not be parsed
    text: str  # the tool response shown to the model
    status: CallStatus
    latency_s: float
    reward: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)


class ToolRunner:
    """Runs turns of tool calls: ``run_turn`` takes every live trajectory's calls of this turn."""

    def __init__(self, timeout_s: float, max_calls_per_turn: int, max_concurrent: int = 32) -> None:
        self.timeout_s = timeout_s
        self.max_calls_per_turn = max_calls_per_turn
        self._pool = ThreadPoolExecutor(max_workers=max_concurrent, thread_name_prefix="rlcli-tool")

    def run_turn(
        self, requests: Sequence[tuple[TrajectoryTools, Sequence[ToolCall | MalformedToolCall]]]
    ) -> list[list[ToolCallOutcome]]:
        """For each ``(trajectory tools, calls)``, the outcomes of its calls in order."""
        pending = []
        outcomes: list[list[ToolCallOutcome | None]] = []
        for row, (tools, calls) in enumerate(requests):
            outcomes.append([None] * len(calls))
            for index, call in enumerate(calls):
                if index >= self.max_calls_per_turn:
                    outcomes[row][index] = ToolCallOutcome(
                        getattr(call, "name", None),
                        f"Error: at most {self.max_calls_per_turn} tool calls run per turn; "
                        f"call {index + 1} was not run",
                        "skipped",
                        0.0,
                    )
                elif isinstance(call, MalformedToolCall):
                    outcomes[row][index] = ToolCallOutcome(None, call.error, "error", 0.0)
                else:
                    pending.append((row, index, self._pool.submit(self._run_one, tools, call)))
        for row, index, future in pending:
            outcomes[row][index] = future.result()
        return outcomes  # type: ignore[return-value]

    def _run_one(self, tools: TrajectoryTools, call: ToolCall) -> ToolCallOutcome:
        box: dict[str, object] = {}

        def target() -> None:
            try:
                box["result"] = tools.call(call.name, call.arguments)
            except BaseException as error:  # reported to the model, never raised into the loop
                box["error"] = error

        start = time.monotonic()
        worker = threading.Thread(target=target, name=f"rlcli-tool-{call.name}", daemon=True)
        worker.start()
        worker.join(self.timeout_s)
        latency = time.monotonic() - start
        if worker.is_alive():
            text = f"Error: {call.name} did not answer within {self.timeout_s:g} s"
            return ToolCallOutcome(call.name, text, "timeout", latency)
        error = box.get("error")
        if isinstance(error, ToolCallRejected):
            return ToolCallOutcome(call.name, str(error), "error", latency)
        if error is not None:
            text = f"Error: {call.name} failed: {type(error).__name__}: {error}"
            return ToolCallOutcome(call.name, text, "error", latency)
        result = box["result"]
        return ToolCallOutcome(
            call.name,
            result.text,
            "ok",
            latency,
            result.reward,
            result.metrics,  # type: ignore[attr-defined]
        )

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def tool_metrics(outcomes: Iterable[ToolCallOutcome]) -> dict[str, float]:
    """``tool/*`` metrics of a set of calls (a step's): counts, error / timeout / skipped rates,
    latency mean and max, and each tool's own metrics averaged (``tool/<name>/<metric>``)."""
    outcomes = list(outcomes)
    if not outcomes:
        return {"tool/calls": 0.0}
    count = len(outcomes)
    ran = [o.latency_s for o in outcomes if o.status in ("ok", "error", "timeout") and o.latency_s]
    metrics = {"tool/calls": float(count)}
    for status in ("error", "timeout", "skipped"):
        metrics[f"tool/{status}_rate"] = sum(o.status == status for o in outcomes) / count
    metrics["tool/latency_mean_s"] = sum(ran) / len(ran) if ran else 0.0
    metrics["tool/latency_max_s"] = max(ran, default=0.0)
    sums: dict[str, list[float]] = {}
    for outcome in outcomes:
        for key, value in outcome.metrics.items():
            sums.setdefault(f"tool/{outcome.name}/{key}", []).append(float(value))
    metrics.update({key: sum(values) / len(values) for key, values in sums.items()})
    return metrics
