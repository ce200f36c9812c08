"""``rlcli top RUN_DIR``: a live view of a run from its folder (running or finished): the step
and its ETA, the last step's phase times, memory and utilisation (``system/*``), rewards and the
last held-out accuracy. It reads only ``metrics.jsonl`` and the newest checkpoint's
``trainer_state.json``, so it works from any machine that sees the folder; rich draws it.

Mounted by rlcli.cli as ``app.command("top")(top_command)``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from rlcli.errors import UserError
from rlcli.run.metrics import METRICS_FILE_NAME, format_eta

RESOURCES = (
    ("host memory (largest rank)", "system/host_rss_gb", "{:.2f} GB"),
    ("machine memory available", "system/host_available_gb", "{:.1f} GB"),
    ("CPU utilisation (mean of ranks)", "system/cpu_util_percent", "{:.0f}%"),
    ("device memory allocated", "system/device_allocated_gb", "{:.2f} GB"),
    ("device memory reserved", "system/device_reserved_gb", "{:.2f} GB"),
    ("device peak this step", "system/device_peak_gb", "{:.2f} GB"),
    ("device utilisation", "system/device_util_percent", "{:.0f}%"),
    ("tokens / s", "perf/tokens_per_s", "{:.0f}"),
)
OUTCOMES = (
    ("reward (mean)", "reward/score_mean"),
    ("accuracy", "reward/accuracy"),
    ("trainer vs engine log-prob diff", "rollout/logprob_diff_mean"),
    ("KL(engine || trainer), k3", "rollout/mismatch_kl_k3"),
)
PHASES_SHOWN = 8


def read_records(run_dir: Path) -> list[dict]:
    """The records so far; a last line still being written is left for the next look."""
    path = run_dir / METRICS_FILE_NAME
    if not path.is_file():
        raise UserError(
            f"{run_dir}: no {METRICS_FILE_NAME} (give a run's trainer.output_dir; a run writes it "
            "when logging.backends has 'jsonl')"
        )
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return [r for r in records if isinstance(r, dict) and "step" in r]


def planned_steps(run_dir: Path) -> int | None:
    """``trainer.total_steps`` as the newest checkpoint recorded it (None before one exists)."""
    states = sorted((run_dir / "checkpoints").glob("step_*/trainer_state.json"))
    for state in reversed(states):
        try:
            total = json.loads(state.read_text())["settings"]["trainer.total_steps"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        return int(total) if total else None
    return None


def render(run_dir: Path, now: float | None = None) -> Group:
    records = read_records(run_dir)
    now = time.time() if now is None else now
    if not records:
        return Group(Text(f"{run_dir}: no step finished yet"))
    steps = [r for r in records if "timing/step" in r]
    last = steps[-1] if steps else records[-1]
    total = planned_steps(run_dir)
    age = now - (run_dir / METRICS_FILE_NAME).stat().st_mtime
    header = f"step {last['step']}" + (f" of {total}" if total else "")
    recent = [r["timing/step"] for r in steps[-5:]]
    if recent:
        seconds = sum(recent) / len(recent)
        header += f" | {seconds:.1f} s/step"
        if total and total > last["step"]:
            header += f" | eta {format_eta(seconds * (total - last['step']))}"
    header += f" | last record {format_eta(age)} ago"

    phases = Table(title="seconds per phase, last step", title_justify="left", min_width=30)
    phases.add_column("phase")
    phases.add_column("s", justify="right")
    timed = sorted(
        ((k.removeprefix("timing/"), v) for k, v in last.items() if k.startswith("timing/")),
        key=lambda item: -item[1],
    )
    for name, value in timed[:PHASES_SHOWN]:
        phases.add_row(name, f"{value:.2f}")

    figures = Table(title="resources and outcomes, last step", title_justify="left", min_width=36)
    figures.add_column("figure")
    figures.add_column("value", justify="right")
    for label, key, shape in RESOURCES:
        if key in last:
            figures.add_row(label, shape.format(last[key]))
    for label, key in OUTCOMES:
        if key in last:
            figures.add_row(label, f"{last[key]:.4g}")
    held_out = [r for r in records if "val/reward/accuracy" in r]
    if held_out:
        figures.add_row(
            f"held-out accuracy (step {held_out[-1]['step']})",
            f"{held_out[-1]['val/reward/accuracy']:.1%}",
        )
    return Group(Text(str(run_dir)), Text(header), phases, figures)


def top_command(
    run_dir: Path = typer.Argument(..., help="The run's folder (its trainer.output_dir)."),
    once: bool = typer.Option(False, "--once", help="Print the view once and exit."),
    interval: float = typer.Option(2.0, "--interval", help="Seconds between refreshes."),
) -> None:
    """A live view of a run: step and ETA, phase times, memory and utilisation, rewards."""
    if interval <= 0:
        raise UserError(f"--interval must be > 0, got {interval}")
    console = Console()
    if once or not console.is_terminal:
        console.print(render(run_dir))
        return
    try:
        with Live(render(run_dir), console=console, refresh_per_second=4) as live:
            while True:
                time.sleep(interval)
                live.update(render(run_dir))
    except KeyboardInterrupt:  # Ctrl-C ends the view, not an error
        pass
