"""Running this command again on N local processes under torchrun: the one relaunch helper that
``train``/``sft --nproc``, ``launch local`` and ``convert --tp/--pp`` share.

torchrun runs inside this (parent) process, so that its failure report can be turned into what a
user needs: when a rank stops on a user error it writes the message to a file in a folder the
parent names (``RLCLI_USER_ERROR_DIR``) and exits 2; the parent prints each distinct message once
and exits 2, instead of torchrun's ChildFailedError traceback. Any other rank failure ends the
parent with exit code 1 and a line naming the ranks (their own tracebacks are printed above it).

The ranks come from a forkserver that imported the training stack once (torchrun's own
``--run-path`` with ``--start-method forkserver``; ``rlcli.cli`` is the script): every rank, and
every rank of a restarted group, starts with torch, transformers, megatron-core (and vLLM when the
run uses it) already imported, instead of importing them itself (5-11 s of CPU a rank, and the
largest share of a restart: ``python -m benchmarks --section recovery``). On a machine with a
GPU (NVIDIA or AMD) the ranks are still started as new processes: a module that queried the
device as it was imported would leave the GPU driver initialised in the forkserver, which no
forked rank could then use, and this path has not been run on a GPU yet.

Restarts (``--max-restarts N``, ``trainer.max_restarts``): torchrun restarts the whole group when a
rank dies, and the trainer resumes from its newest checkpoint. A user error is not worth
retrying: the rank that meets one asks its torchrun agent (its parent process) to stop with
SIGQUIT, so the agent ends the group at once instead of restarting it N times.
"""

from __future__ import annotations

import logging
import os
import signal
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import typer

from rlcli.errors import USER_ERROR_EXIT_CODE
from rlcli.process_lifetime import STOP_FILE_ENV, StopRequest
from rlcli.run.launch import local_torchrun_command, torchrun_prefix

if TYPE_CHECKING:
    from rlcli.config.schema import RLConfig

USER_ERROR_DIR_ENV = "RLCLI_USER_ERROR_DIR"
# The agent's pid, for `stop_agent_restarts`: a forked rank's parent is the forkserver.
AGENT_PID_ENV = "RLCLI_TORCHRUN_AGENT_PID"
GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/kfd")  # an NVIDIA GPU's driver, an AMD GPU's (ROCm)
CLI_SCRIPT = str(Path(__file__).resolve().parents[1] / "cli.py")
# What the forkserver imports before it forks the ranks (vLLM too when the run uses it).
STACK_MODULES = ("rlcli.commands.rank_preload",)
VLLM_MODULES = ("vllm", "rlcli.rollout.vllm_engine")


def under_torchrun() -> bool:
    """True in a process that torchrun (or torch.distributed.run) started."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def ranks_use_vllm(cfg: RLConfig) -> bool:
    """Whether the ranks of this config start vLLM engines: the forkserver then imports vLLM too
    (only what the ranks would import sooner or later)."""
    return cfg.rollout.engine == "vllm"


def relaunch_under_torchrun(
    nproc: int,
    cli_args: list[str],
    max_restarts: int = 0,
    stop_after_step: bool = False,
    with_vllm: bool = False,
) -> NoReturn:
    """Run ``rlcli CLI_ARGS`` on `nproc` local processes under torchrun (restarting the group up
    to `max_restarts` times after a rank dies), then exit with the code `run_torchrun` gives.
    `cli_args` must not contain ``--nproc`` (see `without_nproc`); `with_vllm`: the ranks start
    vLLM engines (the forkserver imports vLLM too)."""
    command = local_torchrun_command(nproc, ["-m", "rlcli.cli", *cli_args], max_restarts)
    raise SystemExit(run_torchrun(command, stop_after_step, with_vllm))


def _forked_ranks(args: Any, with_vllm: bool) -> None:
    """torchrun's parsed arguments for ``-m rlcli.cli ...`` on this machine, changed to fork the
    ranks from a forkserver that has the training stack imported (the module doc)."""
    import multiprocessing

    args.module, args.run_path, args.training_script = False, True, CLI_SCRIPT
    args.start_method = "forkserver"
    multiprocessing.set_forkserver_preload([*STACK_MODULES, *(VLLM_MODULES if with_vllm else ())])
    # `python -u` for the ranks, as torchrun gives a rank it starts as a new process
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    os.environ[AGENT_PID_ENV] = str(os.getpid())


def run_torchrun(command: list[str], stop_after_step: bool = False, with_vllm: bool = False) -> int:
    """Run a torchrun command line (``rlcli.run.launch`` builds them) in this process; the exit code:
    0, 2 after printing the ranks' user errors, or 1 after naming the ranks that failed.

    ``stop_after_step`` (the ranks run the RL trainer, which holds a ``StopRequest``): a first
    Ctrl-C or SIGTERM to this process asks the ranks to stop after their step with a checkpoint,
    through the stop file; only a second one lets torchrun's agent end them. (The ranks run in
    sessions of their own, so a terminal's Ctrl-C reaches this process alone; left to torchrun,
    the first one would end them at once and lose the steps since the last checkpoint.)"""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    prefix = torchrun_prefix()
    if command[: len(prefix)] != prefix:
        raise ValueError(f"not a torchrun command line: {command}")
    # The failure is reported below in a few words; torchrun's own log would repeat it at length.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # torchrun shares its rendezvous TCP store with the workers across restarts, so a restarted
    # group reads the dead group's gloo addresses (connection refused); a store per attempt.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    with tempfile.TemporaryDirectory(prefix="rlcli-errors-") as error_dir:
        os.environ[USER_ERROR_DIR_ENV] = error_dir
        torchrun_args = command[len(prefix) :]
        if stop_after_step:
            _forward_stop_signals(os.environ.setdefault(STOP_FILE_ENV, f"{error_dir}/stop"))
            # torchrun's agent would end the group on these itself; it keeps SIGHUP and SIGQUIT.
            torchrun_args = ["--signals-to-handle=SIGHUP,SIGQUIT", *torchrun_args]
        args = parse_args(torchrun_args)
        ours = args.standalone and args.module and args.training_script == "rlcli.cli"
        if ours and not any(map(os.path.exists, GPU_DEVICE_FILES)):  # (module doc)
            _forked_ranks(args, with_vllm)
        try:
            run(args)
        except ChildFailedError as failed:
            messages = _user_errors(Path(error_dir))
            codes = {rank: failure.exitcode for rank, failure in failed.failures.items()}
            if messages or USER_ERROR_EXIT_CODE in codes.values():
                for message in messages:
                    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
                return USER_ERROR_EXIT_CODE
            shown = ", ".join(f"rank {rank} (exit code {code})" for rank, code in codes.items())
            typer.secho(f"error: {shown} failed; see the output above", err=True)
            return 1
        except SignalException as signalled:
            # A rank's user error stopped the agent (no restarts for it), or we were signalled.
            messages = _user_errors(Path(error_dir))
            if not messages:
                if stop_after_step:  # a second Ctrl-C: the ranks said what they kept
                    return 128 + int(signalled.sigval)
                raise
            for message in messages:
                typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
            return USER_ERROR_EXIT_CODE
        finally:
            del os.environ[USER_ERROR_DIR_ENV]
    return 0


def _forward_stop_signals(stop_file: str) -> None:
    """Ctrl-C / SIGTERM / SIGUSR1 to this process: the first writes the stop file (the ranks'
    ``StopRequest`` reads it after each step), the second is torchrun's (it ends the group)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    def handle(number: int, frame: object) -> None:
        name = signal.Signals(number).name
        if os.path.exists(stop_file):
            print(f"[rlcli] {name} again: stopping the ranks now", flush=True)
            raise SignalException(f"got {name} twice", sigval=signal.Signals(number))
        Path(stop_file).write_text(name)
        again = "Ctrl-C" if number == signal.SIGINT else name
        print(
            f"[rlcli] {name}: the ranks stop after this step with a checkpoint "
            f"({again} again stops them at once)",
            flush=True,
        )

    for number in StopRequest.SIGNALS:
        signal.signal(number, handle)


def report_user_error_to_parent(message: str) -> bool:
    """In a rank started by `run_torchrun`: leave `message` for the parent to print and return
    True. Elsewhere (a single process, or torchrun started by hand or by sbatch): False, and the
    caller prints it. Call `stop_agent_restarts` after either: the agent's SIGTERM to its ranks
    could otherwise kill this one before its message is out."""
    folder = os.environ.get(USER_ERROR_DIR_ENV)
    if folder and under_torchrun() and os.path.isdir(folder):
        rank = os.environ.get("RANK", "0")
        Path(folder, f"rank{int(rank):05d}.txt").write_text(message)
        return True
    return False


def stop_agent_restarts() -> None:
    """Under torchrun with restarts, ask the agent to end the group (see the module doc)."""
    if not under_torchrun() or int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) == 0:
        return
    parent = int(os.environ.get(AGENT_PID_ENV, os.getppid()))
    try:
        with open(f"/proc/{parent}/cmdline", "rb") as handle:
            command = handle.read().replace(b"\0", b" ")
    except OSError:
        return
    if b"torch.distributed.run" in command or b"torchrun" in command or b"rlcli" in command:
        # SIGQUIT: torchrun ends the group on it, and `run_torchrun` leaves it to torchrun (SIGINT
        # and SIGTERM there ask the ranks to stop after their step, which would be retried).
        os.kill(parent, signal.SIGQUIT)


def _user_errors(folder: Path) -> list[str]:
    """The distinct messages the ranks left, in rank order (ranks usually fail alike)."""
    messages: list[str] = []
    for path in sorted(folder.glob("rank*.txt")):
        text = path.read_text()
        if text not in messages:
            messages.append(text)
    return messages


def without_nproc(argv: list[str]) -> list[str]:
    """The command line minus ``--nproc N`` and ``--max-restarts N``: torchrun's own parser would
    take them for its ``--nproc-per-node`` / ``--max-restarts`` (and under torchrun they are
    meaningless anyway)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--nproc", "--max-restarts"):
            skip = True
        elif not arg.startswith(("--nproc=", "--max-restarts=")):
            out.append(arg)
    return out
