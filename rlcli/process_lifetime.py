"""No process outlives its run: every helper process ends when the rank that started it ends,
however the rank ends (normal exit, user error, SIGTERM, SIGKILL of the rank or of its torchrun
agent).

What runs beside a rank, and what ends it:

* megatron-core's checkpoint writer starts a ``multiprocessing`` Manager (spawn; forked on CPU,
  ``parallel.cpu_compat`` says why) at the rank's first save and keeps it for the life of the
  process (``filesystem_async._get_write_results_queue``; no strategy option avoids it). At a
  normal exit or a user error multiprocessing's exit hook shuts it down; when the rank is
  killed nothing would. Spawn children run the parent's main module (``rlcli.cli``, which calls
  :func:`tie_spawned_helper_to_parent` as it is imported) before their target, and forked ones
  multiprocessing's after-fork hooks, which that call registers: either way the Manager asks
  Linux to kill it when the rank dies (``PR_SET_PDEATHSIG``).
* multiprocessing's resource tracker (started with the Manager) and the forkserver of the reward
  workers end by themselves once every process holding their pipe has ended; the reward workers
  (``rlcli.rewards.workers``) die with the forkserver, and a worker past its deadline is killed
  with its process group.
* megatron's writer processes (forked during a save, one per file, joined before the save
  returns) end when their file is written.
* the ``python`` tool's sandboxes (``rlcli.tools.sandbox``) run under bubblewrap with
  ``--die-with-parent`` in their own pid namespace: when the rank dies, bwrap's child is killed
  and with it every process of the namespace (a per-call cgroup of a killed rank stays behind,
  empty: no process).
* vLLM runs in the rank's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): no process.
* A rank started by torchrun is in its own session, so the terminal's signals do not reach it,
  and when torchrun's agent dies it would go on alone: :func:`tie_rank_to_agent` kills it with
  its agent (the agent itself kills each live rank's process group when it stops a group). The
  ranks ``rlcli --nproc`` starts are forked by torchrun's forkserver
  (``rlcli.commands.relaunch``), which ends when the agent does: they die with it, and it with
  the agent.

These are Linux guarantees (``prctl``); elsewhere the helpers end at a normal exit only.

A finished ``rlcli`` process skips the interpreter's teardown (:func:`exit_skipping_teardown`).

And a run asked to end (SIGTERM / SIGUSR1 from Slurm or ``scancel``, or a stop file) ends after
its current step with a checkpoint: :class:`StopRequest`, which the trainer and the rollout ranks
both hold.
"""

from __future__ import annotations

import atexit
import ctypes
import multiprocessing
import multiprocessing.util
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    import torch

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
# A file whose appearance asks the run to stop after the current step with a checkpoint (the
# sbatch script creates it when Slurm warns of preemption or the time limit).
STOP_FILE_ENV = "RLCLI_STOP_FILE"


def die_with_parent(signal_number: int = signal.SIGKILL) -> bool:
    """Ask Linux to send ``signal_number`` to this process when its parent ends (the death signal
    follows the thread that started this process: start helpers from the main thread). False
    where ``prctl`` does not exist."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal_number)) != 0:
            return False
    except (OSError, AttributeError):  # not Linux
        return False
    if os.getppid() == 1:  # the parent ended before the request: it would never come
        os.kill(os.getpid(), signal_number)
    return True


def tie_spawned_helper_to_parent() -> None:
    """In a process multiprocessing started (spawn; its name is not ``MainProcess``): die with
    the parent. Called while ``rlcli.cli`` is imported, which a spawn child does before running
    its target. And in the processes multiprocessing forks from this one from now on (on CPU
    the checkpoint writer's Manager: ``parallel.cpu_compat``), which run no import: the same,
    from multiprocessing's after-fork hook."""
    if multiprocessing.current_process().name != "MainProcess":
        die_with_parent()
    multiprocessing.util.register_after_fork(_FORKED_HELPERS, _die_with_forking_parent)


class _ForkedHelpers:
    """The after-fork registry keeps a weak reference to its key: this one lives forever."""


_FORKED_HELPERS = _ForkedHelpers()


def _die_with_forking_parent(_: object) -> None:
    die_with_parent()


def tie_rank_to_agent() -> None:
    """Call in a rank that torchrun started: die with the agent. SIGKILL, not SIGTERM: without
    its agent the group can neither be restarted nor report, and the newest committed
    checkpoint is safe whenever the rank dies. A rank torchrun forked (`forked_by_torchrun`)
    also leaves the agent's session, as one it starts as a new process does: a terminal's Ctrl-C
    reaches the agent alone, which asks the ranks to stop after their step."""
    if forked_by_torchrun():
        os.setsid()
        _name_process(f"rlcli-rank{os.environ.get('LOCAL_RANK', '')}")
    die_with_parent()


def _name_process(name: str) -> None:
    """The name ``ps``, ``top`` and psutil show for this process (15 characters at most): a rank
    forked by torchrun has its forkserver's command line, which says nothing of the rank."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):  # not Linux
        pass


# What torch.distributed's backends say when a collective's peer process is gone (gloo's TCP
# pair, NCCL's watchdog and its socket layer).
PEER_LOST = (
    "Connection closed by peer",
    "Connection reset by peer",
    "remote process exited or there was a network error",
    "NCCL communicator was aborted",
)


def peer_lost(error: BaseException) -> bool:
    """Whether `error` is a collective that failed because another rank's process is gone."""
    import torch.distributed as dist  # not at import (see StopRequest.agreed)

    text = str(error)
    return isinstance(error, (RuntimeError, dist.DistBackendError)) and any(
        phrase in text for phrase in PEER_LOST
    )


def leave_for_a_restart(error: BaseException, flush: Any = None) -> None:
    """A rank whose peer is gone cannot finish its step, save or close anything that talks to
    the group: say so, `flush` (the metrics), and exit at once, so that torchrun restarts the
    group from the newest checkpoint without waiting on an orderly teardown (2.7 s of the rank's
    4.5 s after a peer's SIGKILL in the recovery benchmark). Its helpers die with it (module
    docstring)."""
    import traceback

    traceback.print_exception(error)
    print(f"[rlcli] another rank is gone ({error}); leaving at once for a restart", flush=True)
    if flush is not None:
        flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


class StopRequest:
    """Ctrl-C (SIGINT), SIGTERM / SIGUSR1 (Slurm preemption, ``scancel``) or a stop file ask the
    run to end after the current step with a checkpoint. ``agreed`` is a collective: every rank
    stops together. A second signal stops at once, after saying which checkpoint is kept
    (``kept``, which the trainer keeps current)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)

    def __init__(self) -> None:
        self.reason: str | None = None
        self.kept = "no checkpoint yet"
        self.stop_file = os.environ.get(STOP_FILE_ENV)
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for number in self.SIGNALS:
                self._previous[number] = signal.signal(number, self._handle)

    def _handle(self, number: int, frame: Any) -> None:
        name = signal.Signals(number).name
        # Asked twice: stop now. The stop file counts as the first ask: a parent that forwarded a
        # Ctrl-C through it signals the ranks only for the second one (``run_torchrun``).
        if self.reason is not None or self._stop_file_reason() is not None:
            print(
                f"[rlcli] {name} again: stopping now without a checkpoint; kept: {self.kept}",
                flush=True,
            )
            signal.signal(number, signal.SIG_DFL)
            os.kill(os.getpid(), number)
            return
        self.reason = name
        again = "Ctrl-C" if number == signal.SIGINT else name
        print(
            f"[rlcli] {name}: stopping after this step with a checkpoint "
            f"({again} again stops at once)",
            flush=True,
        )

    def agreed(self, models: list[torch.nn.Module], elsewhere: str | None = None) -> bool:
        """``elsewhere``: why a process outside this world (a rollout rank) asked to stop."""
        import torch  # not at import: rlcli.cli imports this module in every spawned helper
        import torch.distributed as dist

        if self.reason is None:
            self.reason = self._stop_file_reason()
        if self.reason is None and elsewhere:
            self.reason = elsewhere
        wanted = torch.tensor([1.0 if self.reason else 0.0])
        if dist.is_available() and dist.is_initialized():
            wanted = wanted.to(next(models[0].parameters()).device)
            dist.all_reduce(wanted, op=dist.ReduceOp.MAX)
        if wanted.item() > 0 and self.reason is None:
            self.reason = "another rank was asked to stop"
        return wanted.item() > 0

    def _stop_file_reason(self) -> str | None:
        """Why the stop file asks to stop (its text, else its name); None without one."""
        if not self.stop_file:
            return None
        try:
            with open(self.stop_file, encoding="utf-8", errors="replace") as handle:
                text = handle.read(200).strip()
        except FileNotFoundError:
            return None
        except OSError:
            text = ""
        return text or f"stop file {self.stop_file}"

    def uninstall(self) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)


def forked_by_torchrun() -> bool:
    """True in a rank that torchrun forked from its forkserver (``rlcli.commands.relaunch``
    starts ``rlcli`` ranks so) rather than started as a new interpreter: such a rank ends by
    returning to torchrun's wrapper, which hands torchrun its result, and not by ``os._exit``."""
    return multiprocessing.parent_process() is not None and "TORCHELASTIC_RUN_ID" in os.environ


def run_exit_hooks() -> None:
    """What the interpreter's exit runs before its teardown (see `exit_skipping_teardown`)."""
    # What the interpreter's exit runs first, in its order: threading's exit callbacks (which tell
    # concurrent.futures' pools to stop) and the join of every non-daemon thread; then the hooks.
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing left to flush into
            pass


def exit_skipping_teardown(code: object = 0) -> NoReturn:
    """End the process as Python's own exit does up to its last hook, then stop: non-daemon
    threads joined, every ``atexit`` hook run (multiprocessing's, which shuts the checkpoint
    writer's Manager down; logging's; W&B's), a ``sys.exit`` message printed, the output flushed.
    What is skipped is the interpreter's teardown after those hooks: freeing every module and
    object one by one, about 2 s of CPU in a process that imported torch, transformers,
    megatron-core and vLLM (measured on a 2-core AMD EPYC: 2.0 s from the last line to the exit,
    0.07 s without the teardown), paid by every rank of every run and every CLI call. Nothing
    that teardown would do is needed once the hooks ran: files the run writes are closed (the
    metrics logger, checkpoints) or flushed as written."""
    if code is None or isinstance(code, int):
        status = code or 0
    else:  # sys.exit("message"): printed, status 1, as the interpreter does
        print(code, file=sys.stderr)
        status = 1
    run_exit_hooks()
    os._exit(status)
