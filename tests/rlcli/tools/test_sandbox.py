"""The python tool's sandbox contains what it promises: a timeout, a memory bomb, a fork bomb, a
network attempt and a write outside its directory each end in an error text, and no process of
the call is left afterwards. Every bomb is bounded by the limits set here (small), so a failure
of the sandbox cannot hurt the machine; the network targets are a listener of this test on
127.0.0.1 and TEST-NET-1 (192.0.2.1, reserved for documentation, routed nowhere)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from rlcli.tools.python_tool import PythonTool
from rlcli.tools.sandbox import PythonSandbox, SandboxLimits
from tests.rlcli.tools.sandbox_helpers import MARKER, leftovers

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.skipif(
    shutil.which("bwrap") is None, reason="bubblewrap is not installed (make install adds it)"
)


@pytest.fixture
def sandbox(tmp_path):
    root = tmp_path / "workdirs"
    root.mkdir()
    box = PythonSandbox(
        SandboxLimits(wall_time_s=3, cpu_time_s=3, memory_mb=256, max_processes=12),
        workdir_root=str(root),
    )
    yield box
    assert list(root.iterdir()) == [], "working directories must be removed"
    assert leftovers() == []


def test_stdout_and_stderr_interleave_in_order(sandbox):
    result = sandbox.run(
        "import sys\nprint('out 1')\nprint('err', file=sys.stderr)\nprint('out 2')"
    )
    assert result.output == "out 1\nerr\nout 2\n" and result.exit_code == 0


def test_timeout_kills_the_code_and_what_it_started(sandbox):
    code = f"""
import subprocess, sys, time
# A child in its own session, outside the code's process group: the pid namespace still ends it.
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", "{MARKER}"],
                 start_new_session=True)
print("started", flush=True)
time.sleep(300)
"""
    start = time.monotonic()
    result = sandbox.run(code)
    assert time.monotonic() - start < 3 + 2
    assert result.timed_out and result.exit_code is None
    assert result.output == "started\n"
    assert "timed out after 3 s" in result.notes(sandbox.limits)[0]
    assert leftovers() == []


def test_a_daemon_left_by_finished_code_is_killed(sandbox):
    code = f"""
import subprocess, sys
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", "{MARKER}"],
                 start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print("bye")
"""
    result = sandbox.run(code)
    assert result.exit_code == 0 and result.output == "bye\n"
    assert leftovers() == []


# Each process forks at most twice and the tree is at most 5 deep, so even a sandbox that failed
# to bound it would stop at 63 processes. Every process reports its (sandbox) pid when it starts
# and when the kernel refuses it a fork, each in one write (atomic on a pipe), and none exits
# before the wall limit: the "alive" pids are all the processes the bomb had at once.
FORK_BOMB = """
import os, time
os.write(1, f"alive {os.getpid()}\\n".encode())
depth = forks = 0
while depth < 5 and forks < 2:
    try:
        pid = os.fork()
    except OSError as error:
        os.write(1, f"refused {os.getpid()} {error.errno}\\n".encode())
        break
    if pid == 0:
        os.write(1, f"alive {os.getpid()}\\n".encode())
    depth, forks = (depth + 1, 0) if pid == 0 else (depth, forks + 1)
time.sleep(300)
"""


def test_memory_bomb_gets_memory_error(sandbox):
    # At most 64 blocks of 16 MiB (1 GiB) even unbounded; the limit is 256 MiB.
    code = "blocks = []\nfor _ in range(64):\n    blocks.append(bytearray(16 * 1024 * 1024))"
    result = sandbox.run(code)
    assert "MemoryError" in result.output and result.exit_code == 1, result
    one_big = sandbox.run("x = bytearray(1024 * 1024 * 1024)")  # 1 GiB > 256 MiB
    assert "MemoryError" in one_big.output


def test_fork_bomb_is_bounded_by_max_processes(sandbox):
    result = sandbox.run(FORK_BOMB)
    assert result.timed_out
    lines = [line.split() for line in result.output.splitlines()]
    alive = {words[1] for words in lines if words[0] == "alive"}
    refused = [words for words in lines if words[0] == "refused"]
    assert refused and {words[2] for words in refused} == {"11"}, result.output  # EAGAIN
    assert len(alive) <= sandbox.limits.max_processes - 1, result.output  # + the sandbox's init
    assert leftovers() == []


def test_network_is_unreachable(sandbox):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    code = f"""
import socket
for address in [("127.0.0.1", {port}), ("192.0.2.1", 80)]:
    try:
        socket.create_connection(address, timeout=1)
        print("CONNECTED", address)
    except OSError as error:
        print(address[0], type(error).__name__, error)
"""
    result = sandbox.run(code)
    assert "CONNECTED" not in result.output
    # The sandbox's loopback is its own: nothing listens there. TEST-NET has no route at all.
    assert "127.0.0.1 ConnectionRefusedError" in result.output
    assert "192.0.2.1 OSError [Errno 101] Network is unreachable" in result.output
    with pytest.raises(TimeoutError):
        listener.accept()  # the test's listener on the host saw no connection
    listener.close()


def test_writes_outside_the_working_directory_are_refused(tmp_path):
    # A writable host directory, shown to the code through read_only_paths, with a file the code
    # tries to overwrite, remove and add to; then the sandbox's own read-only places and the
    # interpreter's installation.
    outside_dir = Path(tempfile.mkdtemp(prefix="rlcli-sandbox-test-", dir="/var/tmp"))
    try:
        existing = outside_dir / "existing.txt"
        existing.write_text("original")
        box = PythonSandbox(SandboxLimits(wall_time_s=3), read_only_paths=[str(outside_dir)])
        code = f"""
import os, sys
open("inside.txt", "w").write("ok")
print("inside", open("inside.txt").read(), os.getcwd())
print("shown", open({str(existing)!r}).read())
attempts = [
    ("overwrite", lambda: open({str(existing)!r}, "w").write("escaped")),
    ("remove", lambda: os.remove({str(existing)!r})),
    ("create", lambda: open({str(outside_dir / "new.txt")!r}, "w")),
    ("tmp", lambda: open("/tmp/rlcli-sandbox-write-probe", "w")),
    ("shm", lambda: open("/dev/shm/x", "w")),
    ("parent", lambda: open(os.path.expanduser("~/../rlcli-sandbox-write-probe"), "w")),
    ("root", lambda: open("/x", "w")),
    ("usr", lambda: open("/usr/x", "w")),
    ("prefix", lambda: open(os.path.join(sys.prefix, "x"), "w")),
]
for what, attempt in attempts:
    try:
        attempt()
        print("WROTE", what)
    except OSError as error:
        print("refused", what, error.strerror)
"""
        result = box.run(code)
        assert "inside ok /tmp/sandbox\nshown original\n" in result.output
        assert "WROTE" not in result.output
        assert result.output.count("Read-only file system") == 9, result.output
        assert existing.read_text() == "original"
        assert [p.name for p in outside_dir.iterdir()] == ["existing.txt"]
    finally:
        shutil.rmtree(outside_dir)


def test_output_limit_stops_the_code_early(tmp_path):
    box = PythonSandbox(SandboxLimits(wall_time_s=20, max_output_bytes=1000))
    start = time.monotonic()
    result = box.run("while True:\n    print('y' * 100)")
    assert time.monotonic() - start < 5  # stopped at the limit, not at the wall time
    assert result.output_truncated and len(result.output.encode()) == 1000
    assert "output limit of 1000 bytes" in result.notes(box.limits)[0]
    assert leftovers() == []


def test_cpu_limit_and_file_size_limit(tmp_path):
    box = PythonSandbox(SandboxLimits(wall_time_s=20, cpu_time_s=1, max_file_mb=1))
    spin = box.run("while True:\n    pass")
    assert spin.signal_name == "SIGXCPU" and spin.wall_s < 10
    assert "CPU time limit of 1 s" in spin.notes(box.limits)[0]
    big = box.run("open('big', 'wb').write(b'x' * (2 * 1024 * 1024))")
    assert "File too large" in big.output


def test_python_tool_response_text(tmp_path):
    tool = PythonTool({"wall_time_s": 2, "memory_mb": 256})
    assert tool.execute(None, {"code": "print(sum(range(10)))"}).text == "45\n"
    assert tool.execute(None, {"code": "x = 1"}).text == "(no output)"
    failed = tool.execute(None, {"code": "print('a')\n1/0"})
    assert failed.text.startswith("a\nTraceback") and "ZeroDivisionError" in failed.text
    assert failed.text.endswith("[exit code 1]") and failed.metrics["failed"] == 1.0
    slow = tool.execute(None, {"code": "import time; time.sleep(10)"})
    assert slow.text == "[timed out after 2 s: the code and every process it started were stopped]"
    assert slow.metrics["timed_out"] == 1.0


def test_python_tool_config_errors():
    from rlcli.errors import UserError

    with pytest.raises(UserError, match="unknown config keys \\['wall_time'\\]"):
        PythonTool({"wall_time": 2})
    with pytest.raises(UserError, match="config.memory_mb must be a positive number"):
        PythonTool({"memory_mb": 0})


_UNPRIVILEGED_DRIVER = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
from rlcli.tools.sandbox import PythonSandbox, SandboxLimits
box = PythonSandbox(SandboxLimits(wall_time_s=3, memory_mb=256, max_processes=8),
                    interpreter=sys.executable, workdir_root=sys.argv[2],
                    read_only_paths=[os.path.dirname(sys.argv[4])])
assert box.cgroups is None
bomb = box.run(sys.argv[3])
net = box.run("import socket\\nsocket.create_connection(('192.0.2.1', 80), timeout=1)")
write = box.run("open(%r, 'w')" % sys.argv[4])
print(json.dumps({"bomb": bomb.output, "net": net.output, "write": write.output}))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="switches to the nobody user (needs root)")
@pytest.mark.skipif(
    not Path("/usr/bin/python3").is_file(), reason="needs a system /usr/bin/python3"
)
def test_without_root_rlimits_bound_the_fork_bomb(tmp_path):
    """The non-root path: bubblewrap unprivileged (a user namespace), no cgroup, the fork bomb
    bounded by RLIMIT_NPROC inside the sandbox's user namespace. Run as `nobody` with the system
    Python (this venv's interpreter may not be readable by nobody); the sandbox module needs only
    the standard library, and is imported from a copy nobody can read (the checkout may be in a
    private home)."""
    base = Path(tempfile.mkdtemp(prefix="rlcli-sandbox-test-", dir="/var/tmp"))
    try:
        base.chmod(0o755)
        _readable_copy(ROOT / "rlcli", base / "code" / "rlcli")
        workdirs, outside = base / "workdirs", base / "outside"
        for folder in (workdirs, outside):  # both writable by nobody on the host
            folder.mkdir()
            os.chown(folder, 65534, 65534)
        command = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
        command += ["/usr/bin/python3", "-I", "-c", _UNPRIVILEGED_DRIVER, str(base / "code")]
        command += [str(workdirs), FORK_BOMB, str(outside / "escaped.txt")]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd="/")
        assert proc.returncode == 0, proc.stderr
        outputs = json.loads(proc.stdout)
        lines = [line.split() for line in outputs["bomb"].splitlines()]
        alive = {words[1] for words in lines if words[0] == "alive"}
        assert any(words[0] == "refused" for words in lines), outputs["bomb"]
        assert len(alive) <= 8 - 1, outputs["bomb"]
        assert "Network is unreachable" in outputs["net"]
        assert "Read-only file system" in outputs["write"]
        assert list(outside.iterdir()) == [] and list(workdirs.iterdir()) == []
        assert leftovers() == []
    finally:
        shutil.rmtree(base)


def _readable_copy(package: Path, destination: Path) -> None:
    """The package's Python files, readable by every user whatever the checkout's modes."""
    shutil.copytree(package, destination, ignore=shutil.ignore_patterns("__pycache__"))
    for folder, _, files in os.walk(destination.parent):
        os.chmod(folder, 0o755)
        for name in files:
            os.chmod(os.path.join(folder, name), 0o644)


def test_cgroups_are_removed_after_calls():
    mine = f"rlcli-sandbox-{os.getpid()}-"
    for controller in ("pids", "memory"):
        folder = Path("/sys/fs/cgroup") / controller
        if folder.is_dir():
            assert not [p for p in folder.iterdir() if p.name.startswith(mine)]
    assert sys.platform.startswith("linux")
