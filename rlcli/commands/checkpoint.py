"""``rlcli checkpoint verify DIR``: check checkpoints against their manifests by hand (the same
check a resume makes, ``rlcli.run.manifest``), for a run's checkpoint folder or one step.

Exit codes: 0 every checkpoint is intact; 1 at least one is damaged (or DIR is a step folder
without its COMPLETE marker); 3 none is damaged but at least one has no manifest (saved before
rlcli wrote them) and cannot be verified; 2 DIR holds no checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import typer

from rlcli.errors import UserError

DAMAGED_EXIT_CODE = 1
UNVERIFIABLE_EXIT_CODE = 3

checkpoint_app = typer.Typer(
    help="Inspect run checkpoints (sizes and checksums against each one's manifest).",
    no_args_is_help=True,
)

_COLORS = {
    "intact": typer.colors.GREEN,
    "damaged": typer.colors.RED,
    "unverifiable": typer.colors.YELLOW,
    "incomplete": typer.colors.YELLOW,
}


@checkpoint_app.command("verify")
def verify(
    directory: Path = typer.Argument(
        ...,
        help="A run's output folder (outputs/run), its checkpoint folder (outputs/run/checkpoints) "
        "or one step_N folder.",
    ),
) -> None:
    """Check checkpoints against their manifests: each is intact, damaged or unverifiable.

    Exit code 0: all intact; 1: some damaged; 3: some without a manifest, none damaged; 2: no
    checkpoint in DIRECTORY."""
    from rlcli.run.checkpoints import COMPLETE_MARKER, CheckpointManager
    from rlcli.run.manifest import check_checkpoint
    from rlcli.run.state import TEMPORARY_PREFIX

    if not (directory / COMPLETE_MARKER).is_file() and (directory / "checkpoints").is_dir():
        directory = directory / "checkpoints"  # a run's output folder, as `rlcli plot` takes
    if (directory / COMPLETE_MARKER).is_file():
        committed, incomplete = [directory], []
    elif directory.name.startswith(("step_", TEMPORARY_PREFIX)) and directory.is_dir():
        committed, incomplete = [], [directory]
    else:
        committed = CheckpointManager(directory, rank=0, world_size=1).complete_dirs()
        incomplete = _incomplete_saves(directory)
    if not committed and not incomplete:
        raise UserError(
            f"{directory}: no checkpoints there; pass a run's checkpoint folder (checkpoint.dir, "
            "by default <trainer.output_dir>/checkpoints) or one of its step_N folders"
        )
    states = []
    for path in committed:  # newest commit first, the order trainer.resume=auto tries them in
        health = check_checkpoint(path)
        states.append(health.state)
        _show(path, health.state, health.describe())
    for path in incomplete:
        _show(path, "incomplete", "no COMPLETE marker: an interrupted save, never loaded")
    resumable = [path for path, state in zip(committed, states, strict=True) if state != "damaged"]
    counts = ", ".join(f"{states.count(s)} {s}" for s in ("intact", "damaged", "unverifiable"))
    plural = "s" if len(committed) != 1 else ""
    summary = f"{len(committed)} checkpoint{plural}: {counts}"
    if directory not in committed:  # a run's folder: say where a resume would start
        summary += f"; trainer.resume=auto takes {resumable[0].name}" if resumable else ""
    typer.echo(summary)
    if "damaged" in states or directory in incomplete:
        raise typer.Exit(DAMAGED_EXIT_CODE)
    if "unverifiable" in states:
        raise typer.Exit(UNVERIFIABLE_EXIT_CODE)


def _incomplete_saves(root: Path) -> list[Path]:
    from rlcli.run.checkpoints import COMPLETE_MARKER
    from rlcli.run.state import TEMPORARY_PREFIX

    if not root.is_dir():
        return []
    return sorted(
        path
        for path in root.iterdir()
        if path.is_dir()
        and path.name.startswith(("step_", f"{TEMPORARY_PREFIX}step_"))
        and not (path / COMPLETE_MARKER).is_file()
    )


def _show(path: Path, state: str, detail: str) -> None:
    label = typer.style(f"{state:<12}", fg=_COLORS[state])
    typer.echo(f"{path}  {label} {detail}")
