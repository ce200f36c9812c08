"""Worker processes that run user reward functions with a hard per-call time limit.

A hung thread cannot be stopped, so user code runs in separate processes: each worker takes one
call at a time; a call that passes its deadline gets its worker killed (with its process group)
and a fresh worker started, while the other workers keep going. A worker that dies mid-call
(segfault, ``os._exit``) is replaced the same way. Workers are started with ``forkserver``
(never plain ``fork``: the trainer holds threads and process groups a forked child must not
inherit), ignore Ctrl-C (the trainer owns shutdown) and die with their parent.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from rlcli.errors import UserError
from rlcli.process_lifetime import die_with_parent

START_TIMEOUT_S = 120.0  # a cold worker imports the reward module (and maybe torch): be patient

# Outcome of one call: ("ok", result) | ("error", message) | ("timeout", None)
Outcome = tuple[str, Any]


def _release_forkserver_keepalive() -> None:
    # Every forkserver child inherits the pipe whose EOF tells the forkserver that the trainer
    # is gone. A hung worker holding it would keep the forkserver, and so itself (its death
    # signal is tied to the forkserver, its parent), alive after the trainer is killed.
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    alive_fd = getattr(server, "_forkserver_alive_fd", None)
    if alive_fd is not None:
        os.close(alive_fd)
        server._forkserver_alive_fd = None


def _worker_main(conn: Connection, fn_bytes: bytes) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.setpgrp()  # own process group, so a kill also reaches anything the reward spawned
    _release_forkserver_keepalive()
    die_with_parent()  # not on Linux: workers still exit on EOF from the parent
    try:
        fn = pickle.loads(fn_bytes)
    except BaseException as error:  # report any failure to the parent instead of a bare exit
        conn.send(("startup_error", f"{type(error).__name__}: {error}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        index, kwargs = message
        try:
            conn.send((index, "ok", fn(**kwargs)))
        except UserError as error:
            conn.send((index, "user_error", str(error)))
        except BaseException as error:
            conn.send((index, "error", f"{type(error).__name__}: {error}"))


@dataclass(eq=False)
class _Worker:
    process: Any
    conn: Connection
    state: str = "starting"  # starting -> idle <-> busy
    deadline: float = 0.0
    index: int = -1
    call: dict[str, Any] = field(default_factory=dict)


class WorkerPool:
    """``num_workers`` processes running ``fn(**call)``; see the module docstring."""

    def __init__(self, fn: Any, num_workers: int) -> None:
        try:
            self._fn_bytes = pickle.dumps(fn)
        except Exception as error:
            raise UserError(
                f"reward function {fn!r} cannot be sent to worker processes ({error}); define "
                "it at module top level and name it as 'module:function' or "
                "'path/to/file.py:function'"
            ) from error
        self.num_workers = max(1, num_workers)
        methods = multiprocessing.get_all_start_methods()
        self._context = multiprocessing.get_context(
            "forkserver" if "forkserver" in methods else "spawn"
        )
        self._workers: list[_Worker] = []
        self.num_restarts = 0

    def _start_worker(self) -> _Worker:
        parent_conn, child_conn = self._context.Pipe(duplex=True)
        process = self._context.Process(
            target=_worker_main,
            args=(child_conn, self._fn_bytes),
            daemon=True,
            name="rlcli-reward-worker",
        )
        process.start()
        child_conn.close()
        return _Worker(process, parent_conn, deadline=time.monotonic() + START_TIMEOUT_S)

    def _kill(self, worker: _Worker) -> None:
        if worker.process.is_alive():
            try:
                if worker.state != "starting":
                    os.killpg(worker.process.pid, signal.SIGKILL)
                else:
                    worker.process.kill()
            except (ProcessLookupError, PermissionError):
                worker.process.kill()
        worker.process.join(timeout=10)
        worker.conn.close()

    def _replace(self, worker: _Worker) -> None:
        self._kill(worker)
        self._workers[self._workers.index(worker)] = self._start_worker()
        self.num_restarts += 1

    def run(self, calls: list[dict[str, Any]], timeout_s: float) -> list[Outcome]:
        """Run every call; an outcome per call, in order. ``UserError`` from a call is raised."""
        try:
            return self._run(calls, timeout_s)
        except BaseException:
            # Busy workers would answer calls of this batch during the next one: start over.
            self.close()
            raise

    def _run(self, calls: list[dict[str, Any]], timeout_s: float) -> list[Outcome]:
        while len(self._workers) < self.num_workers:
            self._workers.append(self._start_worker())
        outcomes: list[Outcome | None] = [None] * len(calls)
        pending = deque(range(len(calls)))
        while pending or any(w.state == "busy" for w in self._workers):
            for worker in self._workers:
                if worker.state == "idle" and pending:
                    self._dispatch(worker, pending.popleft(), calls, timeout_s, pending)
            active = [w for w in self._workers if w.state in ("starting", "busy")]
            if not active:
                continue
            next_deadline = min(w.deadline for w in active)
            ready = wait(
                [w.conn for w in active], timeout=max(0.0, next_deadline - time.monotonic())
            )
            for worker in [w for w in active if w.conn in ready]:
                self._receive(worker, outcomes)
            now = time.monotonic()
            for worker in [w for w in self._workers if w.state in ("starting", "busy")]:
                if worker.deadline > now:
                    continue
                if worker.state == "starting":
                    self._kill(worker)
                    raise RuntimeError(
                        f"a reward worker process did not start within {START_TIMEOUT_S:.0f} s"
                    )
                outcomes[worker.index] = ("timeout", None)
                self._replace(worker)
        finished = [outcome for outcome in outcomes if outcome is not None]
        assert len(finished) == len(calls), "every call ends with an outcome"
        return finished

    def _dispatch(
        self,
        worker: _Worker,
        index: int,
        calls: list[dict[str, Any]],
        timeout_s: float,
        pending: deque[int],
    ) -> None:
        try:
            worker.conn.send((index, calls[index]))
        except (BrokenPipeError, OSError):  # died while idle: retry the call on a fresh worker
            pending.appendleft(index)
            self._replace(worker)
            return
        worker.state, worker.index = "busy", index
        worker.deadline = time.monotonic() + timeout_s

    def _receive(self, worker: _Worker, outcomes: list[Outcome | None]) -> None:
        try:
            message = worker.conn.recv()
        except (EOFError, OSError):
            message = None
        if worker.state == "starting":
            if message is not None and message[0] == "ready":
                worker.state = "idle"
                return
            detail = message[1] if message is not None else f"exit code {worker.process.exitcode}"
            self._kill(worker)
            raise UserError(
                f"the reward function could not be loaded in a worker process: {detail}"
            )
        if message is None:  # the process died mid-call
            worker.process.join(timeout=10)
            outcomes[worker.index] = (
                "error",
                f"reward worker process died (exit code {worker.process.exitcode})",
            )
            self._replace(worker)
            return
        index, status, payload = message
        if status == "user_error":
            raise UserError(payload)
        outcomes[index] = (status, payload)
        worker.state = "idle"

    def close(self) -> None:
        """Stop all workers (idle ones exit cleanly; busy or stuck ones are killed)."""
        for worker in self._workers:
            if worker.state == "idle":
                try:
                    worker.conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
                worker.process.join(timeout=2)
            self._kill(worker)
        self._workers = []
