"""What the sandbox tests share: finding processes a sandboxed call left behind."""

from __future__ import annotations

from pathlib import Path

from rlcli.tools.sandbox import BOOTSTRAP_TAG

MARKER = "rlcli-test-leftover-marker"  # tags a child that test code starts inside the sandbox


def leftovers() -> list[str]:
    """Command lines of live processes started by a sandboxed call (the bootstrap, its forks, or
    a child the test code tagged with MARKER)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if (BOOTSTRAP_TAG in cmdline or MARKER in cmdline) and state not in ("Z", "X"):
            found.append(cmdline[:120])
    return found
