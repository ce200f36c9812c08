"""One cgroup per sandboxed call, for the limits rlimits cannot give to root.

The kernel does not apply ``RLIMIT_NPROC`` to processes of the real root user, so as root a fork
bomb is bounded by the cgroup's ``pids.max`` instead; its memory limit bounds all the call's
processes together (``RLIMIT_AS`` bounds each one). cgroup v1 (one hierarchy per controller, as on
the development machines) and v2 (one unified hierarchy) are both handled; only v1 could be
exercised here. Standard library only (see ``rlcli/tools/__init__.py``).
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class CgroupHierarchy:
    """Where per-call cgroups are made: ``pids`` is required, ``memory`` used when present."""

    version: int
    pids_parent: Path
    memory_parent: Path | None


def find_cgroup_hierarchy(root: Path = CGROUP_ROOT) -> CgroupHierarchy | None:
    """A writable hierarchy with the pids controller, or None (not root, read-only, absent)."""
    if (root / "cgroup.controllers").is_file():
        return _find_v2(root)
    pids, memory = root / "pids", root / "memory"
    if not ((pids / "cgroup.procs").is_file() and os.access(pids, os.W_OK)):
        return None
    usable_memory = (memory / "cgroup.procs").is_file() and os.access(memory, os.W_OK)
    return CgroupHierarchy(1, pids, memory if usable_memory else None)


def _find_v2(root: Path) -> CgroupHierarchy | None:
    if "pids" not in (root / "cgroup.controllers").read_text().split():
        return None
    if not os.access(root, os.W_OK):
        return None
    enabled = (root / "cgroup.subtree_control").read_text().split()
    for controller in ("pids", "memory"):
        if controller not in enabled:
            try:
                (root / "cgroup.subtree_control").write_text(f"+{controller}")
            except OSError:  # a non-root cgroup that holds processes cannot delegate controllers
                pass
    enabled = (root / "cgroup.subtree_control").read_text().split()
    if "pids" not in enabled:
        return None
    return CgroupHierarchy(2, root, root if "memory" in enabled else None)


class CallCgroup:
    """The cgroup(s) of one call. A process joins by writing its pid into each of
    ``procs_files`` before it starts the sandbox; everything it forks stays inside."""

    def __init__(self, hierarchy: CgroupHierarchy, max_processes: int, memory_bytes: int) -> None:
        self.hierarchy = hierarchy
        name = f"rlcli-sandbox-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.dirs: list[Path] = []
        try:
            pids_dir = self._make(hierarchy.pids_parent / name)
            (pids_dir / "pids.max").write_text(str(max_processes))
            if hierarchy.memory_parent is not None:
                memory_dir = self._make(hierarchy.memory_parent / name)
                self._limit_memory(memory_dir, memory_bytes)
        except OSError:
            self.remove()
            raise

    @property
    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs]

    def _make(self, path: Path) -> Path:
        if path not in self.dirs:
            path.mkdir()
            self.dirs.append(path)
        return path

    def _limit_memory(self, memory_dir: Path, memory_bytes: int) -> None:
        if self.hierarchy.version == 2:
            (memory_dir / "memory.max").write_text(str(memory_bytes))
            if (memory_dir / "memory.swap.max").exists():
                (memory_dir / "memory.swap.max").write_text("0")
            return
        (memory_dir / "memory.limit_in_bytes").write_text(str(memory_bytes))
        memsw = memory_dir / "memory.memsw.limit_in_bytes"
        if memsw.exists():  # swap accounting on: memory + swap, so no swap at all
            memsw.write_text(str(memory_bytes))

    def pids(self) -> list[int]:
        found: set[int] = set()
        for procs in self.procs_files:
            try:
                found.update(int(p) for p in Path(procs).read_text().split())
            except FileNotFoundError:
                pass
        return sorted(found)

    def kill_all(self, timeout_s: float = 5.0) -> None:
        """SIGKILL every process still in the cgroup, until it is empty (a process may fork while
        the others are killed: repeat)."""
        deadline = time.monotonic() + timeout_s
        while (pids := self.pids()) and time.monotonic() < deadline:
            kill_file = self.dirs[0] / "cgroup.kill"
            if self.hierarchy.version == 2 and kill_file.exists():
                kill_file.write_text("1")
            else:
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            time.sleep(0.01)

    def remove(self) -> None:
        """Remove the cgroup directories (the kernel refuses while a process is still inside)."""
        for path in reversed(self.dirs):
            for _ in range(100):
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # EBUSY: exiting processes are not yet gone
                    time.sleep(0.01)
        self.dirs = [d for d in self.dirs if d.exists()]
