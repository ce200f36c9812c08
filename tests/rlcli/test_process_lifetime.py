"""Helper processes end with their rank (``rlcli.process_lifetime``), checked on megatron-core's
real checkpoint-writer Manager (a spawn child on GPU, forked on CPU): it dies when its rank is SIGKILLed, and a SIGKILLed torchrun
agent takes its rank and the rank's helpers with it. Before the ties both cases left the Manager
(~300 MB) and multiprocessing's resource tracker running with parent 1.

(The same in a whole 2-process run with a restart: ``test_run_restarts.py::
test_rank_killed_mid_run_restarts_and_finishes``.)"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("helper_lifetime_worker.py")


def _start(tmp_path: Path, *launcher: str) -> tuple[subprocess.Popen, dict]:
    """Start the worker (under ``launcher``); once it saved: the launched process and what the
    worker reported (its pid, its helpers' pids and command lines)."""
    out = tmp_path / "pids.json"
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
    }
    log = open(tmp_path / "worker.log", "w")
    cmd = [sys.executable, *launcher, str(WORKER), str(out), str(tmp_path / "ckpt")]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 240
    while not out.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError((tmp_path / "worker.log").read_text()[-3000:])
        time.sleep(0.2)
    return proc, json.loads(out.read_text())


def _processes(pids: list[int]) -> list[psutil.Process]:
    return [psutil.Process(pid) for pid in pids]  # remembers the start time: no pid reuse


def _still_running(processes: list[psutil.Process], within_s: float = 20) -> list[str]:
    """Command lines of the processes still running after ``within_s`` (zombies count as ended:
    this container's init does not reap orphans)."""
    deadline = time.monotonic() + within_s
    while True:
        alive = []
        for process in processes:
            try:
                if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                    alive.append(process)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for process in alive:  # don't leave them to the next test
        process.kill()
    return [" ".join(process.cmdline()) for process in alive]


def test_the_checkpoint_writer_dies_with_its_rank(tmp_path):
    proc, info = _start(tmp_path)
    helpers = _processes([helper["pid"] for helper in info["helpers"]])
    assert info["helpers"], info  # the Manager (forked on CPU: parallel.cpu_compat)
    os.kill(info["rank"], signal.SIGKILL)
    proc.wait(timeout=30)
    assert _still_running(helpers) == []


@pytest.mark.dist
def test_a_killed_torchrun_agent_takes_its_rank_and_the_helpers(tmp_path):
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
    agent, info = _start(tmp_path, *torchrun)
    processes = _processes([info["rank"], *(helper["pid"] for helper in info["helpers"])])
    assert info["helpers"], info  # the Manager (forked on CPU: parallel.cpu_compat)
    agent.kill()
    agent.wait(timeout=30)
    assert _still_running(processes) == []


# A process that holds a StopRequest, then waits for signals the test sends it; it prints what the
# request recorded after each one.
_STOP_REQUEST_PROGRAM = """
import signal, sys, time
from rlcli.process_lifetime import StopRequest
request = StopRequest()
print("ready", flush=True)
seen = None
deadline = time.monotonic() + 60  # a signal never acted on fails the test instead of hanging it
while time.monotonic() < deadline:
    time.sleep(0.01)
    if request.reason != seen:
        seen = request.reason
        print("reason", seen, flush=True)
print("no second signal", flush=True)
"""


@pytest.mark.parametrize("number", [signal.SIGINT, signal.SIGTERM, signal.SIGUSR1])
def test_a_stop_signal_asks_for_a_stop_and_a_second_one_stops_at_once(number):
    """Ctrl-C, SIGTERM and SIGUSR1 ask to stop after the step (the process goes on); the same
    signal again ends the process by that signal, saying which checkpoint is kept. The process
    starts with SIGINT ignored, as a background job of a shell does."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _STOP_REQUEST_PROGRAM],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(number)
        name = signal.Signals(number).name
        assert proc.stdout.readline() == (
            f"[rlcli] {name}: stopping after this step with a checkpoint "
            f"({'Ctrl-C' if number == signal.SIGINT else name} again stops at once)\n"
        )
        assert proc.stdout.readline() == f"reason {name}\n"
        assert proc.poll() is None
        proc.send_signal(number)
        assert proc.wait(timeout=30) == -number
        rest = proc.stdout.read()
        assert f"{name} again: stopping now without a checkpoint; kept: no checkpoint yet" in rest
    finally:
        proc.kill()
        proc.wait()


# `rlcli train --nproc N` in small: run_torchrun over ranks that hold a StopRequest.
_TORCHRUN_PARENT = """
import sys
from rlcli.commands.relaunch import run_torchrun
from rlcli.run.launch import local_torchrun_command
sys.exit(run_torchrun(local_torchrun_command(2, [sys.argv[1]]), stop_after_step=True))
"""


@pytest.mark.dist
@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_to_torchrun_stops_the_ranks_after_their_step_and_twice_at_once(tmp_path, presses):
    """The ranks run in sessions of their own, so a terminal's Ctrl-C reaches the parent alone:
    once, the ranks agree to stop after a step (exit 0, each names SIGINT); twice, torchrun's
    agent ends them at once (exit 130, each says it kept nothing)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("RLCLI_STOP_FILE", None)
    log = open(tmp_path / "run.log", "w+")
    worker = str(Path(__file__).with_name("stop_request_worker.py"))
    proc = subprocess.Popen(
        [sys.executable, "-c", _TORCHRUN_PARENT, worker],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        while "rank 1 step 2" not in (tmp_path / "run.log").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read()
            time.sleep(0.1)
        for _ in range(presses):  # both within one 0.5 s step
            proc.send_signal(signal.SIGINT)
            time.sleep(0.1)
        code = proc.wait(timeout=60)
    finally:
        proc.kill()
    output = (tmp_path / "run.log").read_text()
    assert "[rlcli] SIGINT: the ranks stop after this step with a checkpoint" in output
    if presses == 1:
        assert code == 0, output[-3000:]
        stopped = re.findall(r"rank (\d) stopped after step (\d+) \(SIGINT\)", output)
        assert sorted(rank for rank, _ in stopped) == ["0", "1"], output[-3000:]
        assert len({step for _, step in stopped}) == 1  # together, after the same step
    else:
        assert code == 128 + signal.SIGINT, output[-3000:]
        assert "[rlcli] SIGINT again: stopping the ranks now" in output
        assert output.count("SIGINT again: stopping now without a checkpoint") == 2, output[-3000:]
        assert "stopped after step" not in output


def test_a_collective_whose_peer_is_gone_is_told_apart():
    import torch.distributed as dist

    from rlcli.process_lifetime import peer_lost

    gloo = (
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
        "by peer [127.0.0.1]:38614"
    )
    assert peer_lost(RuntimeError(gloo))
    assert peer_lost(dist.DistBackendError("NCCL communicator was aborted on rank 3"))
    assert not peer_lost(RuntimeError("CUDA out of memory"))
    assert not peer_lost(ValueError(gloo))  # not a collective's error


EXITING = """
import atexit, concurrent.futures, multiprocessing, sys, threading, time
from pathlib import Path
from rlcli.process_lifetime import exit_skipping_teardown

out = Path(sys.argv[1])
atexit.register(lambda: (out / "hook").write_text("ran"))
threading.Thread(target=lambda: (time.sleep(0.5), (out / "thread").write_text("joined"))).start()
pool = concurrent.futures.ThreadPoolExecutor(1)  # its idle worker waits until told to stop
pool.submit(lambda: (out / "pool").write_text("ran"))
helper = multiprocessing.Process(target=time.sleep, args=(600,), daemon=True)
helper.start()
(out / "helper").write_text(str(helper.pid))
print("buffered, not flushed", end="")
exit_skipping_teardown(sys.argv[2] if sys.argv[2] == "a message" else int(sys.argv[2]))
"""


@pytest.mark.parametrize(("code", "status"), [("0", 0), ("3", 3), ("a message", 1)])
def test_an_exit_without_teardown_still_does_what_pythons_exit_does(tmp_path, code, status):
    """`rlcli` ends its processes without the interpreter's teardown (2 s a rank): the exit status,
    a joined non-daemon thread, a thread pool told to stop, the atexit hooks (multiprocessing's
    ends a daemon helper, as at a usual exit), a sys.exit message and unflushed output must all be
    as Python leaves them."""
    proc = subprocess.run(
        [sys.executable, "-c", EXITING, str(tmp_path), code],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == status, proc.stderr
    assert proc.stdout == "buffered, not flushed"
    assert (proc.stderr.strip() == "a message") == (code == "a message"), proc.stderr
    assert (tmp_path / "hook").read_text() == "ran"
    assert (tmp_path / "thread").read_text() == "joined"
    assert (tmp_path / "pool").read_text() == "ran"
    assert not psutil.pid_exists(int((tmp_path / "helper").read_text()))
