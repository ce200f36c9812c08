"""Steps of the checkpoints a ``CheckpointManager`` sees, for assertions (the product finds
checkpoints by directory: ``complete_dirs`` / ``latest_dir``)."""

from __future__ import annotations

from rlcli.run.checkpoints import REPLACED_PREFIX, CheckpointManager, checkpoint_step


def _step(path) -> int:
    # A ``.replaced-step_N`` stands in for step N while ``step_N`` is missing.
    return checkpoint_step(path.name.removeprefix(REPLACED_PREFIX))


def complete_steps(manager: CheckpointManager) -> list[int]:
    """Steps with a complete checkpoint, ascending."""
    return sorted(_step(path) for path in manager.complete_dirs())


def latest_step(manager: CheckpointManager) -> int | None:
    """The step of the most recently committed complete checkpoint (None: there is none)."""
    latest = manager.latest_dir()
    return None if latest is None else _step(latest)
