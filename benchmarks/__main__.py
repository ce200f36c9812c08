"""``python -m benchmarks`` (what ``make benchmark`` runs): rlcli against the simplest alternative
and the physical floor on this machine's hardware; writes
``benchmarks/results/<date>-<host>[-quick].{json,md,png}``.

By default the quick set of sections (minutes); ``--full`` runs every one (``make
benchmark-full``). It says which sections run and about how long they take before it starts, and
leaves no process behind when it is stopped (lifetime.py).

The benchmark sits above the product: it imports rlcli, and rlcli never imports it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from benchmarks.lifetime import end_with_parent, exit_on_sigterm
from benchmarks.run import QUICK_SECTIONS, RESULTS_DIR, SECTIONS, run_benchmark

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


@app.command()
def benchmark(
    smoke: bool = typer.Option(
        False, "--smoke", help="Tiny sizes, 1-2 iterations: checks the code, not the speed."
    ),
    output_dir: Optional[Path] = typer.Option(
        None, "--output-dir", help="Where results go (default: benchmarks/results of the repo)."
    ),
    full: bool = typer.Option(
        False,
        "--full",
        help=f"Every section; without it the quick set: {', '.join(QUICK_SECTIONS)}.",
    ),
    sections: Optional[list[str]] = typer.Option(
        None,
        "--section",
        help=(
            "Run only this section (repeatable; instead of the quick set or --full): device, "
            "rollout, sync, train, lora, grpo, placement, mismatch, recovery."
        ),
    ),
    stop_with_parent: bool = typer.Option(
        False,
        "--stop-with-parent",
        help="End when the process that started this one ends, even killed (make passes it).",
    ),
) -> None:
    """Benchmark rollout, weight sync, the actor update, a short GRPO run, the rollout
    placements, the trainer/engine mismatch and recovery from a lost rank; write a report. Says first which sections run and about how long they take."""
    if stop_with_parent:
        end_with_parent()
    unknown = [name for name in sections or [] if name not in SECTIONS]
    if unknown:
        raise typer.BadParameter(
            f"{unknown[0]!r} is not a section; choose from {list(SECTIONS)}",
            param_hint="--section",
        )
    outputs = run_benchmark(
        smoke=smoke,
        output_dir=output_dir or RESULTS_DIR,
        sections=sections or (SECTIONS if full else QUICK_SECTIONS),
        log=typer.echo,
    )
    typer.echo(outputs.files["md"].read_text())
    for kind, path in outputs.files.items():
        typer.echo(f"wrote {kind}: {path}")
    if outputs.results["errors"]:
        failed = ", ".join(sorted(outputs.results["errors"]))
        typer.secho(f"benchmark sections failed: {failed}", err=True, fg=typer.colors.RED)
        raise typer.Exit(1)


if __name__ == "__main__":
    exit_on_sigterm()  # here, not in the command: a test invoking the command keeps its handler
    app()
