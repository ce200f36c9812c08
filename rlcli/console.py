"""What a run tells its user on the console: one line, from global rank 0 only."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from parallel.mesh import Mesh


def say(mesh: Mesh, message: str) -> None:
    """Print ``[rlcli] message`` on the mesh's rank 0 (the other ranks say the same)."""
    if mesh.rank == 0:
        print(f"[rlcli] {message}", flush=True)
