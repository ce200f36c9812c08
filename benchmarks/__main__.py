"""``python -m benchmarks`` (what ``make benchmark`` runs): rlcli against the simplest alternative
and the physical floor on this machine's hardware; writes
``benchmarks/results/<date>-<host>.{json,md,png}``.

The benchmark sits above the product: it imports rlcli, and rlcli never imports it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from benchmarks.run import RESULTS_DIR, SECTIONS, run_benchmark

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


@app.command()
def benchmark(
    smoke: bool = typer.Option(
        False, "--smoke", help="Tiny sizes, 1-2 iterations: checks the code, not the speed."
    ),
    output_dir: Optional[Path] = typer.Option(
        None, "--output-dir", help="Where results go (default: benchmarks/results of the repo)."
    ),
    sections: Optional[list[str]] = typer.Option(
        None,
        "--section",
        help="Run only this section (repeatable): device, rollout, sync, train, lora, grpo.",
    ),
) -> None:
    """Benchmark rollout, weight sync, the actor update and a short GRPO run; write a report."""
    unknown = [name for name in sections or [] if name not in SECTIONS]
    if unknown:
        raise typer.BadParameter(
            f"{unknown[0]!r} is not a section; choose from {list(SECTIONS)}",
            param_hint="--section",
        )
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


if __name__ == "__main__":
    app()
