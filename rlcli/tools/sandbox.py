"""Run untrusted Python code in a separate, contained process (the ``python`` tool's sandbox).

Built from what Linux provides, through bubblewrap (``bwrap``, Debian package ``bubblewrap``):

- namespaces: new user, pid, network, IPC, UTS and cgroup namespaces. The network namespace has
  only a loopback device of its own, so no address outside the sandbox is reachable; the pid
  namespace dies with its first process, so nothing the code starts outlives the call.
- filesystem (``rlcli.tools.sandbox_mounts``): an empty read-only root showing only what the
  interpreter needs (its installation, the system's ``/usr`` and ``ld.so.cache``), the paths of
  ``read_only_paths``, a new ``/proc`` and a minimal read-only ``/dev``, and the call's fresh
  working directory ``/tmp/sandbox`` (a host temporary directory, removed afterwards): the only
  place the code can write. No home directory, checkout, run output or data.
- privileges: every capability dropped, no_new_privs, no nested user namespaces (bubblewrap >=
  0.8), a cleared environment, stdin from /dev/null.
- rlimits, set by the interpreter inside the sandbox before the code runs: CPU seconds, address
  space (memory per process), file size, open files, no core dumps, and processes (and threads)
  per user inside the sandbox's user namespace.
- as root, where the kernel ignores the process rlimit, a per-call cgroup (``rlcli.tools.cgroups``)
  bounds the processes and the memory of all the call's processes together.
- the wall time and the output size are enforced here: beyond either, the whole process group is
  killed (and with it the pid namespace).

Standard library only (see ``rlcli/tools/__init__.py``).
"""

from __future__ import annotations

import json
import math
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from rlcli.errors import UserError
from rlcli.tools.cgroups import CallCgroup, CgroupHierarchy, find_cgroup_hierarchy
from rlcli.tools.sandbox_mounts import (
    SANDBOX_DIR,
    checked_read_only_paths,
    filesystem_arguments,
    find_interpreter,
    interpreter_paths,
    read_only_binds,
)

CODE_FILE = "main.py"
BOOTSTRAP_TAG = "rlcli-sandbox-bootstrap"
# Runs inside the sandbox as `python -I -u -c BOOTSTRAP main.py LIMITS_JSON`: the limits first,
# then the code as __main__, with a traceback that starts at the code's own frame.
BOOTSTRAP = f"""# {BOOTSTRAP_TAG}
import json, os, resource, sys, traceback
for name, (soft, hard) in json.loads(sys.argv[2]).items():
    resource.setrlimit(getattr(resource, name), (soft, hard))
path = sys.argv[1]
sys.argv = [path]
sys.path.insert(0, os.getcwd())
with open(path, encoding="utf-8") as code_file:
    code = compile(code_file.read(), path, "exec")
try:
    exec(code, {{"__name__": "__main__", "__file__": path, "__builtins__": __builtins__}})
except SystemExit:
    raise
except BaseException as error:
    traceback.print_exception(type(error), error, error.__traceback__.tb_next)
    sys.exit(1)
"""
_MIB = 1024 * 1024


@dataclass(frozen=True)
class SandboxLimits:
    """What one call may use. ``max_processes`` counts processes and threads, the interpreter and
    the sandbox's own init process included."""

    wall_time_s: float = 10.0
    cpu_time_s: float = 10.0
    memory_mb: int = 1024  # address space per process; as root also all processes together
    max_processes: int = 32
    max_output_bytes: int = 16384  # stdout + stderr; beyond it the code is stopped
    max_file_mb: int = 16  # largest file the code may write
    max_open_files: int = 64

    def rlimits(self) -> dict[str, tuple[int, int]]:
        cpu = max(1, math.ceil(self.cpu_time_s))
        # Soft CPU limit: SIGXCPU; one second later the hard limit's SIGKILL.
        return {
            "RLIMIT_CPU": (cpu, cpu + 1),
            "RLIMIT_AS": (self.memory_mb * _MIB, self.memory_mb * _MIB),
            "RLIMIT_FSIZE": (self.max_file_mb * _MIB, self.max_file_mb * _MIB),
            "RLIMIT_NOFILE": (self.max_open_files, self.max_open_files),
            "RLIMIT_NPROC": (self.max_processes, self.max_processes),
            "RLIMIT_CORE": (0, 0),
        }


@dataclass
class SandboxResult:
    """One run. ``exit_code`` is the code's exit status (bubblewrap reports death by signal N as
    128 + N: ``signal_name``), None when the run was stopped here (``timed_out`` or
    ``output_truncated``)."""

    output: str  # stdout and stderr, interleaved as written, at most max_output_bytes
    exit_code: int | None
    timed_out: bool
    output_truncated: bool
    wall_s: float

    @property
    def signal_name(self) -> str | None:
        code = self.exit_code
        if code is None or not 128 < code < 128 + signal.NSIG:
            return None
        try:
            return signal.Signals(code - 128).name
        except ValueError:
            return None

    def notes(self, limits: SandboxLimits) -> list[str]:
        """Why the run ended, if not by finishing normally, in words meant for the model."""
        if self.timed_out:
            return [
                f"timed out after {limits.wall_time_s:g} s: the code and every process it "
                "started were stopped"
            ]
        if self.output_truncated:
            return [
                f"output limit of {limits.max_output_bytes} bytes reached: the code was stopped"
            ]
        if self.signal_name == "SIGXCPU":
            return [f"CPU time limit of {limits.cpu_time_s:g} s reached: the code was stopped"]
        if self.signal_name == "SIGKILL":
            return ["killed (SIGKILL): over the memory or CPU time limit"]
        if self.signal_name is not None:
            return [f"killed by {self.signal_name}"]
        if self.exit_code:
            return [f"exit code {self.exit_code}"]
        return []


class PythonSandbox:
    """Runs code with ``interpreter`` (default: this Python, so its installed packages are there)
    under ``limits``; the code sees the interpreter's installation and ``read_only_paths`` (host
    paths, shown read-only at the same path), nothing else of the host's files. Construction
    checks that the sandbox can be built on this machine and raises ``UserError`` saying what is
    missing; ``run`` is safe to call from several threads."""

    def __init__(
        self,
        limits: SandboxLimits = SandboxLimits(),
        interpreter: str | None = None,
        workdir_root: str | None = None,
        read_only_paths: list[str] | tuple[str, ...] = (),
    ) -> None:
        self.limits = limits
        self.interpreter = find_interpreter(interpreter or sys.executable)
        self.workdir_root = workdir_root
        extra = checked_read_only_paths(read_only_paths)
        # Everything of the host the code can see, besides the system folders (read-only).
        self.read_only_paths = read_only_binds(interpreter_paths(self.interpreter) + extra)
        self.bwrap = shutil.which("bwrap")
        if self.bwrap is None:
            raise UserError(
                "the python tool's sandbox needs bubblewrap (bwrap), which is not installed: "
                "apt-get install bubblewrap (make install does it as root)"
            )
        self.cgroups: CgroupHierarchy | None = None
        if os.geteuid() == 0:
            self.cgroups = find_cgroup_hierarchy()
            if self.cgroups is None:
                raise UserError(
                    "running as root, the python tool bounds its processes with a cgroup (the "
                    "kernel does not apply RLIMIT_NPROC to root), and no writable cgroup with "
                    "the pids controller is mounted at /sys/fs/cgroup: run rlcli as a non-root "
                    "user, or give it a writable cgroup hierarchy"
                )
        self._disable_userns = _bwrap_version(self.bwrap) >= (0, 8)
        probe = self.run("pass")
        if probe.exit_code != 0:
            raise UserError(
                f"the python tool's sandbox does not start on this machine (exit code "
                f"{probe.exit_code}): {probe.output.strip()!r}; bubblewrap needs user namespaces "
                "(sysctl kernel.unprivileged_userns_clone=1, or on Ubuntu 24.04 "
                "kernel.apparmor_restrict_unprivileged_userns=0), and the interpreter "
                f"{self.interpreter} must start seeing only /usr and its installation "
                f"({', '.join(self.read_only_paths)}): add what else it loads to the tool's "
                "config key read_only_paths"
            )

    def run(self, code: str) -> SandboxResult:
        """Run ``code`` as ``main.py`` in a fresh working directory; wait at most the wall time."""
        workdir = Path(tempfile.mkdtemp(prefix="rlcli-python-", dir=self.workdir_root))
        cgroup = None
        try:
            (workdir / CODE_FILE).write_text(code, encoding="utf-8")
            launcher: list[str] = []
            if self.cgroups is not None:
                cgroup = CallCgroup(
                    self.cgroups, self.limits.max_processes, self.limits.memory_mb * _MIB
                )
                launcher = _join_cgroup_launcher(cgroup.procs_files)
            return self._run(launcher, workdir)
        finally:
            if cgroup is not None:
                cgroup.kill_all()
                cgroup.remove()
            shutil.rmtree(workdir, onerror=_make_writable_and_retry)

    def _bwrap_command(self, workdir: Path, info_fd: int) -> list[str]:
        interpreter_dir = os.path.dirname(self.interpreter)
        environment = {
            "PATH": f"{interpreter_dir}:/usr/local/bin:/usr/bin:/bin",
            "HOME": SANDBOX_DIR,
            "TMPDIR": SANDBOX_DIR,
            "LANG": "C.UTF-8",
            # No /etc/passwd inside: getpass.getuser() and its users read the name from here.
            "USER": "sandbox",
            "LOGNAME": "sandbox",
            # One thread per numerical library: threads count against max_processes and memory.
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        }
        command = [self.bwrap, "--unshare-all", "--unshare-user"]
        if self._disable_userns:
            command.append("--disable-userns")
        command += ["--cap-drop", "ALL", "--die-with-parent", "--new-session"]
        command += filesystem_arguments(str(workdir), self.read_only_paths)
        command += ["--chdir", SANDBOX_DIR, "--clearenv"]
        for key, value in environment.items():
            command += ["--setenv", key, value]
        command += ["--info-fd", str(info_fd), "--", self.interpreter, "-I", "-u", "-c", BOOTSTRAP]
        return command + [CODE_FILE, json.dumps(self.limits.rlimits())]

    def _run(self, command: list[str], workdir: Path) -> SandboxResult:
        limits = self.limits
        info_read, info_write = os.pipe()
        start = time.monotonic()
        try:
            # start_new_session: the sandbox is one process group, killed as one.
            process = subprocess.Popen(
                command + self._bwrap_command(workdir, info_fd=info_write),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                pass_fds=(info_write,),
                env={"PATH": "/usr/bin:/bin"},
            )
        finally:
            os.close(info_write)
        deadline = start + limits.wall_time_s
        output, timed_out, truncated = _read_output(process, deadline, limits.max_output_bytes)
        if not (timed_out or truncated):
            try:
                process.wait(timeout=max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                timed_out = True
        if timed_out or truncated:
            _kill_group(process)
        process.stdout.close()  # type: ignore[union-attr]
        sandbox_init = _read_child_pid(info_read)
        _wait_until_gone(sandbox_init)
        return SandboxResult(
            output=output.decode("utf-8", errors="replace"),
            exit_code=None if (timed_out or truncated) else process.returncode,
            timed_out=timed_out,
            output_truncated=truncated,
            wall_s=time.monotonic() - start,
        )


def _join_cgroup_launcher(procs_files: list[str]) -> list[str]:
    """A shell that moves itself into each cgroup, then becomes the sandbox (``exec``): the cgroup
    holds every process of the sandbox from its first one on."""
    script = 'for f do [ "$f" = -- ] && break; echo $$ > "$f" || exit 125; shift; done; shift; '
    return ["/bin/sh", "-c", script + 'exec "$@"', "sh", *procs_files, "--"]


def _read_output(
    process: subprocess.Popen, deadline: float, max_bytes: int
) -> tuple[bytes, bool, bool]:
    """(output, timed out, truncated): read until EOF, the deadline, or more than ``max_bytes``."""
    assert process.stdout is not None
    fd = process.stdout.fileno()
    os.set_blocking(fd, False)
    chunks, size = [], 0
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return b"".join(chunks), True, False
            if not selector.select(remaining):
                continue
            data = os.read(fd, 65536)
            if not data:
                return b"".join(chunks), False, False
            keep = data[: max_bytes - size]
            chunks.append(keep)
            size += len(keep)
            if len(keep) < len(data):
                return b"".join(chunks), False, True


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def _read_child_pid(info_read: int) -> int | None:
    """The host pid of the sandbox's init process, from bwrap's ``--info-fd`` JSON."""
    with os.fdopen(info_read, "rb") as info:
        text = info.read().decode(errors="replace")
    match = re.search(r'"child-pid"\s*:\s*(\d+)', text)
    return int(match.group(1)) if match else None


def _wait_until_gone(pid: int | None, timeout_s: float = 5.0) -> None:
    """Wait for the sandbox's init process to be dead: the kernel kills every other process of a
    pid namespace before its init finishes exiting, so then nothing of the call runs."""
    if pid is None:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError, IndexError):
            return
        if state in ("Z", "X"):
            return
        time.sleep(0.005)


def _bwrap_version(bwrap: str) -> tuple[int, ...]:
    output = subprocess.run([bwrap, "--version"], capture_output=True, text=True).stdout
    match = re.search(r"(\d+)\.(\d+)", output)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


def _make_writable_and_retry(function, path, _exc_info) -> None:
    """rmtree's error handler: the code may have removed its own write permission on a file."""
    try:
        os.chmod(os.path.dirname(path), 0o700)
        os.chmod(path, 0o700)
        function(path)
    except OSError:
        pass
