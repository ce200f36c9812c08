"""``rlcli benchmark``: rlcli against the simplest alternative and the physical floor, on this
machine's hardware; writes ``benchmarks/results/<date>-<host>.{json,md,png}`` (see benchmarks/).

Mounted by rlcli.cli as ``app.command("benchmark")(benchmark_command)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from rlcli.errors import UserError


def benchmark_command(
    smoke: bool = typer.Option(
        False, "--smoke", help="Tiny sizes, 1-2 iterations: checks the code, not the speed."
    ),
    output_dir: Optional[Path] = typer.Option(
        None, "--output-dir", help="Where results go (default: benchmarks/results of the repo)."
    ),
    sections: Optional[list[str]] = typer.Option(
        None,
        "--section",
        help="Run only this section (repeatable): device, rollout, sync, train, grpo.",
    ),
) -> None:
    """Benchmark rollout, weight sync, the actor update and a short GRPO run; write a report."""
    from benchmarks.run import RESULTS_DIR, SECTIONS, run_benchmark

    unknown = [name for name in sections or [] if name not in SECTIONS]
    if unknown:
        raise UserError(f"--section {unknown[0]!r} is not a section; choose from {list(SECTIONS)}")
    outputs = run_benchmark(
        smoke=smoke,
        output_dir=output_dir or RESULTS_DIR,
        sections=sections or SECTIONS,
        log=typer.echo,
    )
    typer.echo(outputs.files["md"].read_text())
    for kind, path in outputs.files.items():
        typer.echo(f"wrote {kind}: {path}")
    if outputs.results["errors"]:
        failed = ", ".join(sorted(outputs.results["errors"]))
        typer.secho(f"benchmark sections failed: {failed}", err=True, fg=typer.colors.RED)
        raise typer.Exit(1)
