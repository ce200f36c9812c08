"""What the python tool's sandbox shows of the host file system: the interpreter and nothing else.

The sandbox's root is an empty tmpfs (bubblewrap's own), remounted read-only once these are in it:

- the system folders a dynamically linked interpreter loads from: ``/usr``, and ``/bin``, ``/lib``,
  ``/lib64`` (as the symlinks into ``/usr`` they are on a merged-/usr system, else bound);
- of ``/etc`` only ``ld.so.cache``, which the dynamic loader reads to find libraries outside its
  default folders (``/usr/local/lib``, ...); Python itself reads nothing there;
- the interpreter's installation: ``sys.prefix``, ``sys.base_prefix`` (a venv's base, often in a
  home directory, e.g. ``~/.pyenv/versions/3.11.7``: that folder, never the home around it),
  ``sys.exec_prefix``, ``sys.base_exec_prefix``, each at the path the interpreter uses and at its
  real path; the executable itself where it lies outside them;
- the paths of the tool's ``read_only_paths`` config key (none by default);
- a new ``/dev``, a ``/proc`` of the sandbox's own pid namespace, the call's working directory.

Everything is bound read-only at its own path, so paths inside the sandbox read as on the host. No
home directory, checkout, run output or data set is there unless it lies inside one of these.

Standard library only (see ``rlcli/tools/__init__.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

from rlcli.errors import UserError

SANDBOX_DIR = "/tmp/sandbox"  # the call's working directory as the code sees it
SYSTEM_FOLDERS = ("/usr", "/bin", "/lib", "/lib64")
ETC_FILES = ("/etc/ld.so.cache",)
# Where the sandbox mounts its own things: nothing from the host may cover or sit inside them.
RESERVED = (SANDBOX_DIR, "/proc", "/dev")
_PREFIXES_PROBE = (
    "import json, sys; "
    "print(json.dumps([sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]))"
)


def find_interpreter(interpreter: str) -> str:
    """The absolute path of ``interpreter`` (a path, or a name looked up on PATH)."""
    found = shutil.which(interpreter)
    if found is None:
        raise UserError(
            f"the python tool's interpreter {interpreter!r} is not an executable file "
            "(config key interpreter: a Python's path, or a name on PATH)"
        )
    return os.path.abspath(found)


def interpreter_paths(executable: str) -> list[str]:
    """What the sandbox binds so ``executable`` starts and imports its standard library and
    installed packages: its prefixes (asked of the interpreter itself, so a configured one that
    differs from this Python is right too) and the executable where it lies outside them."""
    try:
        probe = subprocess.run(
            [executable, "-I", "-c", _PREFIXES_PROBE],
            capture_output=True,
            text=True,
            timeout=60,
            env={"PATH": "/usr/bin:/bin"},
            cwd="/",
        )
        prefixes = json.loads(probe.stdout)
    except (OSError, subprocess.TimeoutExpired, ValueError) as error:
        raise UserError(
            f"the python tool's interpreter {executable} did not report its installation "
            f"folders ({type(error).__name__}: {error}); set config key interpreter to a "
            "working Python"
        ) from None
    paths = []
    for path in [*prefixes, executable, os.path.realpath(executable)]:
        paths += [path, os.path.realpath(path)]
    for path in paths:
        if path == "/":
            raise UserError(
                f"the python tool's interpreter {executable} is installed at / (prefix /): the "
                "sandbox would show the whole file system; use a Python installed in a folder "
                "of its own (config key interpreter), e.g. a venv"
            )
    return paths


def checked_read_only_paths(paths: object) -> list[str]:
    """The ``read_only_paths`` config key: absolute paths of existing files or folders."""
    if not isinstance(paths, (list, tuple)) or not all(isinstance(p, str) for p in paths):
        raise UserError(f"config.read_only_paths must be a list of absolute paths, got {paths!r}")
    for path in paths:
        if not os.path.isabs(path) or not os.path.exists(path):
            raise UserError(
                f"config.read_only_paths: {path!r} is not an absolute path of an existing file "
                "or folder"
            )
        if os.path.realpath(path) == "/":
            raise UserError("config.read_only_paths: / would show the whole file system")
    return [os.path.normpath(p) for p in paths]


def read_only_binds(paths: list[str]) -> list[str]:
    """The fewest paths that show all of ``paths``: without those inside the system folders or
    inside another one, ordered so a folder is mounted before anything inside it."""
    kept: list[str] = []
    for path in sorted({os.path.normpath(p) for p in paths}):
        if not os.path.exists(path) or _inside(path, [*SYSTEM_FOLDERS, *kept]):
            continue
        for reserved in RESERVED:
            if _inside(path, [reserved]) or _inside(reserved, [path]):
                raise UserError(
                    f"{path} would cover or sit inside {reserved}, which the python tool's "
                    "sandbox mounts itself; install the interpreter (config key interpreter) "
                    "or place read_only_paths elsewhere"
                )
        kept.append(path)
    return kept


def filesystem_arguments(workdir: str, read_only: list[str]) -> list[str]:
    """bubblewrap's arguments for the file system described above; ``workdir`` (a host folder)
    is the only writable place, at ``SANDBOX_DIR``. ``read_only`` comes from
    ``read_only_binds``."""
    arguments: list[str] = []
    for folder in SYSTEM_FOLDERS:
        if os.path.islink(folder):
            arguments += ["--symlink", os.readlink(folder), folder]
        elif os.path.isdir(folder):
            arguments += ["--ro-bind", folder, folder]
    for file in ETC_FILES:
        if os.path.isfile(file):
            arguments += ["--ro-bind", file, file]
    arguments += ["--dev", "/dev", "--remount-ro", "/dev", "--proc", "/proc"]
    # The interpreter after the working directory: one under /tmp (a clone there) stays visible.
    arguments += ["--bind", workdir, SANDBOX_DIR]
    for path in read_only:
        arguments += ["--ro-bind", path, path]
    return arguments + ["--remount-ro", "/"]


def _inside(path: str, folders: list[str]) -> bool:
    return any(path == folder or path.startswith(folder.rstrip("/") + "/") for folder in folders)
