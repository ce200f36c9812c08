"""Score a batch of responses; a reward function that fails or hangs never stops training.

Builtin rewards (registered ``in_process=True``: regexes, math-verify with its own timeouts) run
directly in the trainer's process, the fast path. Any other function runs in worker processes
with a hard per-call timeout (see ``workers.py``). A call that raises, returns something that is
not a number / ``{"score": number, ...}``, returns a non-finite score, or times out scores 0 and
is counted. A ``UserError`` (e.g. an unknown data_source for the default reward) is a
configuration mistake, not a bad sample, and is raised.
"""

from __future__ import annotations

import logging
import math
import numbers
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlcli.errors import UserError
from rlcli.rewards.registry import RewardFn, is_in_process_reward
from rlcli.rewards.workers import Outcome, WorkerPool

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RewardInput:
    """One response to score: the arguments of ``compute_score``."""

    data_source: str
    solution_str: str
    ground_truth: Any
    extra_info: dict[str, Any] | None = None


def _call_kwargs(item: RewardInput | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(item, Mapping):
        return {
            "data_source": item["data_source"],
            "solution_str": item["solution_str"],
            "ground_truth": item["ground_truth"],
            "extra_info": item.get("extra_info"),
        }
    return {
        "data_source": item.data_source,
        "solution_str": item.solution_str,
        "ground_truth": item.ground_truth,
        "extra_info": item.extra_info,
    }


def _as_score(result: Any) -> tuple[float, dict[str, Any]]:
    """``(score, extra fields)`` from a reward result; ``ValueError`` when it is not one."""
    extras: dict[str, Any] = {}
    if isinstance(result, Mapping):
        if "score" not in result:
            raise ValueError(f"reward dict has no 'score' key (keys: {sorted(result)})")
        extras = {key: value for key, value in result.items() if key != "score"}
        result = result["score"]
    if hasattr(result, "item") and not isinstance(result, (str, bytes)):
        result = result.item()  # numpy / torch scalars
    if not isinstance(result, numbers.Real):
        raise ValueError(f"reward is a {type(result).__name__}, expected a number")
    score = float(result)
    if not math.isfinite(score):
        raise ValueError(f"reward is {score}")
    return score, extras


class RewardManager:
    """Batch scorer around one reward function (``compute_score`` signature).

    Args:
        fn: the reward function, e.g. ``resolve_reward_fn("gsm8k")``.
        timeout_s: per-call limit for functions run in worker processes.
        num_workers: worker processes (default: min(4, CPU count)).
        in_process: ``None`` chooses (builtins in process, everything else in workers);
            ``True`` / ``False`` force it.
    """

    def __init__(
        self,
        fn: RewardFn,
        timeout_s: float = 30.0,
        num_workers: int | None = None,
        in_process: bool | None = None,
    ) -> None:
        if timeout_s <= 0:
            raise UserError(f"reward timeout_s must be > 0, got {timeout_s}")
        self.fn = fn
        self.timeout_s = timeout_s
        self.in_process = is_in_process_reward(fn) if in_process is None else in_process
        workers = num_workers if num_workers is not None else min(4, os.cpu_count() or 1)
        self._pool = None if self.in_process else WorkerPool(fn, workers)
        # The last score_batch's first failure, in the reward's own words (None: none failed).
        self.first_failure: str | None = None

    def score_batch(
        self, items: Sequence[RewardInput | Mapping[str, Any]]
    ) -> tuple[list[float], dict[str, list[Any]], dict[str, int]]:
        """Score every item.

        Returns ``(scores, extras, stats)``: ``scores[i]`` a float (0.0 for a failed or timed
        out call); ``extras[key][i]`` the extra dict fields (``None`` where sample ``i`` has
        none); ``stats`` with ``reward/num_failed`` and ``reward/num_timeout``.
        """
        calls = [_call_kwargs(item) for item in items]
        if self._pool is None:
            outcomes = [self._call_in_process(call) for call in calls]
        else:
            outcomes = self._pool.run(calls, self.timeout_s)

        scores: list[float] = []
        extras: dict[str, list[Any]] = {}
        failures: list[tuple[int, str]] = []
        num_timeout = 0
        for index, (status, payload) in enumerate(outcomes):
            score, fields = 0.0, {}
            if status == "ok":
                try:
                    score, fields = _as_score(payload)
                except ValueError as error:
                    failures.append((index, str(error)))
            elif status == "timeout":
                num_timeout += 1
            else:
                failures.append((index, payload))
            scores.append(score)
            for key, value in fields.items():
                extras.setdefault(key, [None] * len(calls))[index] = value

        if failures:
            index, message = failures[0]
            logger.warning(
                "reward function failed on %d of %d samples (scored 0); first: sample %d "
                "(data_source %r): %s",
                len(failures),
                len(calls),
                index,
                calls[index]["data_source"],
                message,
            )
        if num_timeout:
            logger.warning(
                "%d of %d reward calls timed out after %.1f s (scored 0)",
                num_timeout,
                len(calls),
                self.timeout_s,
            )
        self.first_failure = None
        if failures:
            index, message = failures[0]
            self.first_failure = (
                f"sample with data_source {calls[index]['data_source']!r}: {message}"
            )
        elif num_timeout:
            self.first_failure = f"reward calls timed out after {self.timeout_s:.1f} s"
        stats = {"reward/num_failed": len(failures), "reward/num_timeout": num_timeout}
        return scores, extras, stats

    def _call_in_process(self, call: dict[str, Any]) -> Outcome:
        try:
            return "ok", self.fn(**call)
        except UserError:
            raise
        except Exception as error:
            return "error", f"{type(error).__name__}: {error}"

    def close(self) -> None:
        """Stop the worker processes (a later ``score_batch`` starts new ones)."""
        if self._pool is not None:
            self._pool.close()

    def __enter__(self) -> RewardManager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        pool = getattr(self, "_pool", None)
        if pool is not None:
            try:
                pool.close()
            except Exception:  # interpreter shutdown: workers die with the process anyway
                pass
