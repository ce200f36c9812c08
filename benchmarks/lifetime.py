"""No benchmark process outlives the benchmark, however it ends: a timeout, Ctrl-C, or a
scheduler's SIGTERM or SIGKILL of ``make`` or of ``python -m benchmarks``.

    run_in_own_group(command, cwd=, env=, log_file=, timeout_s=) -> None or why it failed
    stop_group(child)             kill a child and everything it started
    exit_on_sigterm()             in the top process: SIGTERM unwinds (its child group is killed)
    end_with_parent()             in the top process: SIGTERM when its parent (make) ends
    take_group_down_with_parent() in a section process: its whole group dies when its parent ends

Each section runs in its own session (so a group of its own): the terminal's Ctrl-C reaches only
the top process, which kills the section's group as it unwinds. When the top process dies
without unwinding (SIGKILL), the section process learns it from Linux (``PR_SET_PDEATHSIG``,
with SIGHUP, a signal nothing in a section uses) and kills its own group: the ``rlcli train``
runs and torchrun agents it started go with it, and their ranks die with their agent
(``rlcli.process_lifetime``). A process that leaves the group on purpose (its own session) must
tie itself to its parent, as rlcli's ranks do.

These are Linux guarantees; elsewhere a killed top process leaves its section running.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from rlcli.process_lifetime import die_with_parent

# The signal a section process receives when its parent ends: not one the trainer handles
# (SIGINT / SIGTERM / SIGUSR1 ask a run to stop after its step, which would go on to the next
# section), and one no terminal sends to a process in a session of its own.
PARENT_ENDED_SIGNAL = signal.SIGHUP


def run_in_own_group(
    command: list[str], *, cwd: Path, env: dict[str, str], log_file: Path, timeout_s: float
) -> str | None:
    """Run `command` in a session of its own, output to `log_file`; None when it exits 0, else
    why it did not. On a timeout the child's group is killed; so it is when this process is
    interrupted (Ctrl-C, or SIGTERM after :func:`exit_on_sigterm`), before the exception goes on."""
    with open(log_file, "w", encoding="utf-8") as log_handle:
        child = subprocess.Popen(command, cwd=cwd, env=env, stdout=log_handle,
                                 stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        try:
            returncode = child.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stop_group(child)
            return f"the benchmark process timed out after {timeout_s:.0f} s"
        except BaseException:
            stop_group(child)
            raise
    return None if returncode == 0 else f"the benchmark process exited with code {returncode}"


def stop_group(child: subprocess.Popen) -> None:
    """Kill the child and everything it started (its session's process group)."""
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:  # the group has ended already
        pass
    child.wait()


def exit_on_sigterm() -> None:
    """SIGTERM (``timeout``, ``kill``, a scheduler) raises SystemExit(143) instead of ending the
    process on the spot, so the section running is stopped with its group and the temporary
    folder removed. Call from the main thread."""
    signal.signal(signal.SIGTERM, _exit)


def end_with_parent() -> None:
    """SIGTERM this process when its parent ends, even by SIGKILL (``make benchmark`` asks for
    it: make killed leaves no benchmark behind). Not the default: ``nohup python -m benchmarks &``
    must outlive the shell that started it."""
    exit_on_sigterm()
    die_with_parent(signal.SIGTERM)


def take_group_down_with_parent() -> None:
    """In a section process (the leader of its own group): when the parent ends, however it
    ends, kill this process and everything in its group. Call first thing, from the main thread."""
    signal.signal(PARENT_ENDED_SIGNAL, _kill_own_group)
    die_with_parent(PARENT_ENDED_SIGNAL)


def _kill_own_group(number: int, frame: Any) -> None:
    if os.getpgid(0) == os.getpid():  # started by run_in_own_group: the group is the section's
        os.killpg(0, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)  # started some other way: this process alone


def _exit(number: int, frame: Any) -> None:
    sys.exit(128 + number)
