"""The messages between the trainer and the rollout ranks of ``rollout.placement=separate``.

Trainer -> rollout ranks, in order: ``Notice`` n = 0, 1, 2, ... (the launch's store, key
``notice/n``): "weights version v are ready" (their buckets follow over the weights group, or
they did not change), "evaluate them on the held-out prompts", or "stop". Notice 0 also says
where the run starts (a resume's loader position). Every version from the start on is announced
exactly once, in order.

Rollout ranks -> trainer: each step's ``StreamedBatch`` (rollout rank 0 sends it over the samples
group, announced in the store: ``batch/<step>``), held-out metrics (``val/<version>``), a stop
request (SIGTERM on a rollout rank), and a failure from either side (``failure/<role>``).

Waiting polls the store every few milliseconds, so a waiting rank notices at once when the other
role failed or asked to stop (a blocking collective would hold it until the group times out).
Batches travel pickled: they come only from this job's own ranks.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed import PrefixStore

from parallel.roles import RoleWorld
from rlcli.errors import UserError
from rlcli.rollout.batch import Sample

POLL_S = 0.005  # a store check is one round trip to the store's server


@dataclass
class Notice:
    """What trainer rank 0 tells the rollout ranks (module docstring)."""

    version: int  # the weights after this step
    weights: bool = False  # their buckets follow over the weights group (False: unchanged)
    validate: bool = False  # evaluate version ``version`` on the held-out prompts
    stop: bool = False  # the run ends: generate nothing more
    start_loader: dict[str, Any] | None = None  # notice 0: the trainer's consumed position


@dataclass
class StreamedBatch:
    """One step's samples from the rollout ranks, and where they came from."""

    step: int  # the trainer's step that trains on them
    samples: list[Sample]
    metrics: dict[str, float]  # Sampler.collect's (rewards, lengths, DAPO) and the engines' own
    weight_version: int  # the weights that generated them
    loader_before: dict[str, Any]  # the loader before the step's prompts were drawn ...
    loader_after: dict[str, Any]  # ... and after (what the trainer has consumed once trained)
    engine: dict[str, float] = field(default_factory=dict)  # engine/* timings


class RunEnded(Exception):
    """The trainer failed: the rollout ranks stop without a word (the trainer reports it)."""


class RolloutChannel:
    """One rank's end of the channel (module docstring); both roles build one."""

    def __init__(self, world: RoleWorld, timeout_s: float) -> None:
        self.world = world
        self.store = PrefixStore("channel/", world.store)
        self.timeout_s = timeout_s
        self._next_notice = 0
        self._unfinished: list[tuple[Any, torch.Tensor]] = []  # sends not yet received

    # -- trainer side -------------------------------------------------------------------------

    def send_notice(self, notice: Notice) -> None:
        """Trainer rank 0: the next notice."""
        self.store.set(f"notice/{self._next_notice}", pickle.dumps(notice))
        self._next_notice += 1

    def receive_batch(self, step: int) -> StreamedBatch:
        """Trainer rank 0: step ``step``'s batch (waits for it)."""
        key = f"batch/{step}"
        self._wait(key, f"the samples of step {step}")
        size = int(self.store.get(key))
        data = torch.empty(size, dtype=torch.uint8)
        self.world.samples.recv([data], 1, step).wait()
        self.store.delete_key(key)
        return pickle.loads(data.numpy().tobytes())

    def receive_validation(self, version: int) -> dict[str, float]:
        """Trainer rank 0: the held-out metrics of weights ``version``."""
        key = f"val/{version}"
        self._wait(key, f"the held-out evaluation of step {version}")
        metrics = pickle.loads(self.store.get(key))
        self.store.delete_key(key)
        return metrics

    def stop_requested(self) -> str | None:
        """Any rank: why a rollout rank asked the run to stop (None: none did)."""
        if not self.store.check(["stop_request"]):
            return None
        return self.store.get("stop_request").decode()

    # -- rollout side -------------------------------------------------------------------------

    def receive_notice(self, between_polls: Callable[[], None] = lambda: None) -> Notice:
        """Every rollout rank: the next notice (waits; ``between_polls`` runs while it does)."""
        key = f"notice/{self._next_notice}"
        self._wait(key, "the trainer's next weights", between_polls, timeout=False)
        self._next_notice += 1
        return pickle.loads(self.store.get(key))

    def send_batch(self, batch: StreamedBatch) -> None:
        """Rollout rank 0: hand ``batch`` over without waiting for the trainer to take it."""
        data = torch.frombuffer(bytearray(pickle.dumps(batch)), dtype=torch.uint8)
        work = self.world.samples.send([data], 0, batch.step)
        self._unfinished = [(w, t) for w, t in self._unfinished if not w.is_completed()]
        self._unfinished.append((work, data))  # the tensor must live until it is received
        self.store.set(f"batch/{batch.step}", str(data.numel()))

    def send_validation(self, version: int, metrics: dict[str, float]) -> None:
        """Rollout rank 0: the held-out metrics of weights ``version``."""
        self.store.set(f"val/{version}", pickle.dumps(metrics))

    def request_stop(self, reason: str) -> None:
        """Any rollout rank: ask the trainer to stop after its current step (with a checkpoint)."""
        self.store.set("stop_request", reason.encode())

    # -- both ---------------------------------------------------------------------------------

    def report_failure(self, error: BaseException) -> None:
        """This role failed: the other role's waits end with the same message."""
        user = isinstance(error, UserError)
        record = {"user_error": user, "message": str(error) if user else repr(error)}
        self.store.set(f"failure/{self.world.role}", pickle.dumps(record))

    def _wait(
        self,
        key: str,
        what: str,
        between_polls: Callable[[], None] = lambda: None,
        timeout: bool = True,
    ) -> None:
        """Until ``key`` exists; raises when the other role failed (or, with ``timeout``, when
        nothing came within the channel's timeout: ``parallel.timeout_minutes``)."""
        other = "rollout" if self.world.is_trainer else "trainer"
        deadline = time.monotonic() + self.timeout_s
        while not self.store.check([key]):
            if self.store.check([f"failure/{other}"]):
                self._raise_failure(other)
            if timeout and time.monotonic() > deadline:
                raise RuntimeError(
                    f"no {what} from the {other} ranks within {self.timeout_s:.0f} s "
                    "(parallel.timeout_minutes)"
                )
            between_polls()
            time.sleep(POLL_S)

    def _raise_failure(self, role: str) -> None:
        record = pickle.loads(self.store.get(f"failure/{role}"))
        if role == "trainer":
            raise RunEnded(record["message"])
        if record["user_error"]:
            raise UserError(record["message"])
        raise RuntimeError(f"a rollout rank failed: {record['message']}")
