"""What sandboxed code can see of the host's files, tried as an attacker would: a secret planted in
a home directory, a run's data file with its answers, the checkout, the host through
``/proc/1/root``, a listing of ``/``. Each must be absent, while standard-library code still runs,
also with an interpreter whose venv lives under ``/tmp`` (a clone there)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from rlcli.errors import UserError
from rlcli.tools.python_tool import PythonTool
from rlcli.tools.sandbox import PythonSandbox, SandboxLimits
from rlcli.tools.sandbox_mounts import ETC_FILES, RESERVED, SYSTEM_FOLDERS
from tests.rlcli.tools.sandbox_helpers import leftovers

pytestmark = pytest.mark.skipif(
    shutil.which("bwrap") is None, reason="bubblewrap is not installed (make install adds it)"
)
SECRET = "rlcli-test-secret-4-plus-36-is-40"
# Prints, for each path in argv order, what the code got: its text, its entries, or the error.
PROBE = """
import json, os
seen = {}
for path in PATHS:
    try:
        seen[path] = sorted(os.listdir(path)) if os.path.isdir(path) else open(path).read()
    except OSError as error:
        seen[path] = type(error).__name__
print(json.dumps(seen))
"""


@pytest.fixture(scope="module")
def sandbox():
    box = PythonSandbox(SandboxLimits(wall_time_s=5, memory_mb=256, max_processes=8))
    yield box
    assert leftovers() == []


def _seen(box: PythonSandbox, paths: list[str]) -> dict:
    result = box.run(f"PATHS = {paths!r}\n" + PROBE)
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def _allowed_entries(box: PythonSandbox, folder: str) -> set[str]:
    """The names the sandbox may show in ``folder``: the next step towards each thing it mounts."""
    mounted = [*SYSTEM_FOLDERS, *ETC_FILES, *RESERVED, *box.read_only_paths]
    prefix = folder.rstrip("/") + "/"
    return {path[len(prefix) :].split("/")[0] for path in mounted if path.startswith(prefix)}


def test_a_secret_in_a_home_directory_is_not_there(sandbox, tmp_path):
    home = tmp_path / "home" / "someone"
    home.mkdir(parents=True)
    (home / ".netrc").write_text(f"machine example.com password {SECRET}\n")
    through_proc = "/proc/1/root" + str(home / ".netrc")
    paths = [str(home / ".netrc"), through_proc, str(home), "/home", "/root"]
    planted = None
    if os.access("/root", os.W_OK):  # as root: root's own home, where credentials live
        handle, planted = tempfile.mkstemp(prefix="rlcli-test-secret-", dir="/root")
        os.write(handle, SECRET.encode())
        os.close(handle)
        paths.append(planted)
    try:
        seen = _seen(sandbox, paths)
    finally:
        if planted is not None:
            os.remove(planted)
    assert SECRET not in json.dumps(seen)
    assert seen[str(home / ".netrc")] == seen[str(home)] == "FileNotFoundError"
    assert seen[through_proc] == "FileNotFoundError"
    if planted is not None:
        assert seen[planted] == "FileNotFoundError"
    for folder in ("/home", "/root"):
        # At most the way to the interpreter's own installation (e.g. /root/.pyenv).
        if isinstance(seen[folder], list):
            assert set(seen[folder]) <= _allowed_entries(sandbox, folder), seen[folder]


def test_the_runs_data_and_outputs_are_not_there(sandbox, tmp_path):
    data = tmp_path / "outputs" / "quickstart" / "data" / "sft_train.jsonl"
    data.parent.mkdir(parents=True)
    data.write_text(json.dumps({"prompt": "Question: 4 + 36 = ?", "response": SECRET}) + "\n")
    cwd = os.getcwd()  # where a run's outputs/ usually is
    seen = _seen(sandbox, [str(data), str(tmp_path / "outputs"), cwd, cwd + "/outputs"])
    assert SECRET not in json.dumps(seen)
    assert seen[str(data)] == seen[str(tmp_path / "outputs")] == "FileNotFoundError"
    if isinstance(seen[cwd], list):
        assert set(seen[cwd]) <= _allowed_entries(sandbox, cwd), seen[cwd]


def test_the_checkout_is_not_there(sandbox):
    checkout = Path(__file__).resolve().parents[3]
    seen = _seen(sandbox, [__file__, str(checkout / "rlcli"), str(checkout)])
    assert seen[__file__] == seen[str(checkout / "rlcli")] == "FileNotFoundError"
    # The checkout's folder exists inside only when the interpreter's venv lies in it.
    if isinstance(seen[str(checkout)], list):
        assert set(seen[str(checkout)]) <= _allowed_entries(sandbox, str(checkout))


def test_root_and_proc_show_only_the_sandbox(sandbox):
    result = sandbox.run(
        "import json, os\n"
        "pids = [p for p in os.listdir('/proc') if p.isdigit()]\n"
        "print(json.dumps([sorted(os.listdir('/')), sorted(os.listdir('/proc/1/root')), "
        "sorted(os.listdir('/etc')) if os.path.isdir('/etc') else [], pids]))"
    )
    assert result.exit_code == 0, result.output
    root, proc_root, etc, pids = json.loads(result.output)
    assert set(root) <= _allowed_entries(sandbox, "/") and "sys" not in root, root
    assert proc_root == root  # pid 1 is the sandbox's own init, in the sandbox's root
    assert set(etc) <= {os.path.basename(file) for file in ETC_FILES}
    assert len(pids) <= 3  # bubblewrap's init, the interpreter (and no host process)


def test_standard_library_code_runs(sandbox):
    code = (
        "import collections, json, math, re, subprocess, sys\n"
        "words = re.findall(r'[a-z]+', 'the cat and the hat')\n"
        "print(json.dumps(collections.Counter(words).most_common(1)), math.comb(5, 2))\n"
        "print(subprocess.run([sys.executable, '-c', 'print(6 * 7)'], capture_output=True, "
        "text=True).stdout.strip())"
    )
    result = sandbox.run(code)
    assert result.output == '[["the", 2]] 10\n42\n' and result.exit_code == 0


def test_an_interpreter_under_tmp_starts(tmp_path):
    """A clone under /tmp: its venv (made here without pip: seconds) is bound after the
    sandbox's scratch folder, so it stays visible; its neighbours stay hidden."""
    clone = Path(tempfile.mkdtemp(prefix="rlcli-clone-", dir="/tmp"))
    try:
        subprocess.run(
            [sys.executable, "-m", "venv", "--without-pip", str(clone / ".venv")],
            check=True,
            timeout=120,
        )
        (clone / "secret.txt").write_text(SECRET)
        box = PythonSandbox(
            SandboxLimits(wall_time_s=5), interpreter=str(clone / ".venv/bin/python")
        )
        result = box.run(
            "import json, math, os, sys\n"
            f"print(sys.prefix, math.isqrt(1600), os.path.exists({str(clone / 'secret.txt')!r}))"
        )
        assert result.output == f"{clone / '.venv'} 40 False\n", result.output
    finally:
        shutil.rmtree(clone)
    assert leftovers() == []


def test_read_only_paths_config(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "facts.txt").write_text("42")
    tool = PythonTool({"wall_time_s": 5, "read_only_paths": [str(shared)]})
    assert str(shared) in tool.sandbox.read_only_paths
    reply = tool.execute(None, {"code": f"print(open({str(shared / 'facts.txt')!r}).read())"})
    assert reply.text == "42\n"
    with pytest.raises(UserError, match="config.read_only_paths must be a list"):
        PythonTool({"read_only_paths": str(shared)})
    with pytest.raises(UserError, match="'relative/path' is not an absolute path"):
        PythonTool({"read_only_paths": ["relative/path"]})
    with pytest.raises(UserError, match="would cover or sit inside /tmp/sandbox"):
        PythonTool({"read_only_paths": ["/tmp"]})
