"""``make demo-sweep`` (``python -m benchmarks.demo_sweep run``): the quickstart, ``make demo``'s
``rlcli train recipes/quickstart.yaml``, over seeds (``trainer.seed``) x OpenMP thread counts.

One run proves nothing about the recipe: its outcome follows float rounding (the CPU, the thread
count, the kernels), so the claim is a range. Each run is a fresh ``rlcli train`` process in a
fresh output folder, exactly as a user starts it; from it come the held-out accuracy after the
SFT warm start (step 0 of ``metrics.jsonl``) and after RL (the last held-out evaluation), and
wall times timestamped from the run's own log lines (SFT: from ``warm start:`` to ``building
actor``; RL: from there to the process's exit; total: launch to exit).

    python -m benchmarks.demo_sweep run [--seeds 1,2,3] [--threads 1,2] [--label L] [--runs F]
                                        [--recipe R] [--work-dir D] [OVERRIDE ...]
    python -m benchmarks.demo_sweep table RUNS.jsonl [--label L ...] [--output MD]

``run`` appends one JSON line per run to ``--runs`` (default
``benchmarks/results/demo-sweep-<date>-<host>.jsonl``) and rewrites the Markdown table of that
file next to it; ``table`` rewrites it from any runs file (e.g. after runs made one at a time).
"""

from __future__ import annotations

import datetime
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

import typer

from benchmarks.demo_sweep_report import sweep_markdown
from benchmarks.hardware import load_average
from benchmarks.lifetime import stop_group
from benchmarks.run import REPO_ROOT, RESULTS_DIR, child_env, last_lines
from rlcli.machine import cpu_model

DEFAULT_RECIPE = REPO_ROOT / "recipes" / "quickstart.yaml"
RUN_TIMEOUT_S = 1800
SFT_START_LINE = "[rlcli] warm start:"
RL_START_LINE = "[rlcli] building actor"

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


def run_demo(
    recipe: Path, overrides: list[str], seed: int, threads: int, output_dir: Path, label: str
) -> dict:
    """One ``rlcli train`` of ``recipe`` at ``trainer.seed=seed`` with ``OMP_NUM_THREADS=threads``
    into ``output_dir``; the run's record (see the module docstring)."""
    command = [sys.executable, "-m", "rlcli.cli", "train", str(recipe), *overrides,
               f"trainer.seed={seed}", f"trainer.output_dir={output_dir}"]  # fmt: skip
    env = {**child_env(threads), "PYTHONUNBUFFERED": "1"}
    record: dict = {
        "label": label,
        "recipe": _relative(recipe),
        "overrides": overrides,
        "seed": seed,
        "threads": threads,
        "cpu": cpu_model(),
        "host": socket.gethostname().split(".")[0],
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "commit": _commit(),
        "load_average_start": load_average(),
    }
    marks: dict[str, float] = {}
    lines: list[str] = []
    start = time.perf_counter()
    # Own session: a timeout stops the run and everything it started (the engine's processes).
    child = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    timer = threading.Timer(RUN_TIMEOUT_S, stop_group, args=(child,))
    timer.start()
    try:
        assert child.stdout is not None
        for line in child.stdout:
            lines.append(line.rstrip("\n"))
            for name, marker in (("sft", SFT_START_LINE), ("rl", RL_START_LINE)):
                if line.startswith(marker) and name not in marks:
                    marks[name] = time.perf_counter() - start
        returncode = child.wait()
    except BaseException:  # Ctrl-C reaches only this process (the run has its own session)
        stop_group(child)
        raise
    finally:
        timer.cancel()
    total = time.perf_counter() - start
    record.update(returncode=returncode, total_s=total, load_average_end=load_average())
    if "sft" in marks and "rl" in marks:
        record.update(sft_s=marks["rl"] - marks["sft"], rl_s=total - marks["rl"])
    if returncode != 0:
        record["error"] = last_lines("\n".join(lines))
        return record
    record.update(accuracies(output_dir / "metrics.jsonl"))
    return record


def accuracies(metrics_file: Path) -> dict:
    """``before`` (step 0), ``after`` (the last evaluation), ``curve`` {step: accuracy} of
    ``val/reward/accuracy``, and the median ``timing/step`` of a run's metrics.jsonl."""
    from rlcli.run.metrics import read_metrics_jsonl

    records = read_metrics_jsonl(metrics_file)
    curve = {
        str(r["step"]): r["val/reward/accuracy"] for r in records if "val/reward/accuracy" in r
    }
    steps = [r["timing/step"] for r in records if "timing/step" in r]
    return {
        "before": curve.get("0"),
        "after": list(curve.values())[-1] if curve else None,
        "curve": curve,
        "median_step_s": statistics.median(steps) if steps else None,
    }


def read_runs(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _relative(path: Path) -> str:
    resolved = path.resolve()
    return str(resolved.relative_to(REPO_ROOT)) if resolved.is_relative_to(REPO_ROOT) else str(path)


def _commit() -> str | None:
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT,
                          capture_output=True, text=True)  # fmt: skip
    if proc.returncode != 0:
        return None
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                           cwd=REPO_ROOT, capture_output=True, text=True).stdout.strip()  # fmt: skip
    return proc.stdout.strip() + ("+changes" if dirty else "")


def _int_list(text: str, option: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1 and option == "--threads":
        raise typer.BadParameter(f"{text!r}: give comma-separated integers, e.g. 1,2,3")
    return values


def write_table(runs_file: Path, labels: list[str] | None, output: Path | None) -> Path:
    runs = [r for r in read_runs(runs_file) if not labels or r["label"] in labels]
    if not runs:
        raise typer.BadParameter(
            f"{runs_file} has no runs" + (f" labelled {labels}" if labels else "")
        )
    target = output or runs_file.with_suffix(".md")
    target.write_text(sweep_markdown(runs))
    return target


@app.command()
def run(
    overrides: Optional[list[str]] = typer.Argument(None, help="Dot-list overrides of the recipe."),
    recipe: Path = typer.Option(DEFAULT_RECIPE, help="The recipe to sweep."),
    seeds: str = typer.Option("1,2,3", help="trainer.seed values, comma-separated."),
    threads: str = typer.Option("1,2", help="OMP_NUM_THREADS values, comma-separated."),
    label: Optional[str] = typer.Option(None, help="Names this configuration in the table."),
    runs: Optional[Path] = typer.Option(None, help="JSON-lines file the runs are appended to."),
    work_dir: Optional[Path] = typer.Option(
        None, help="Keep each run's output folder here (default: a temporary folder)."
    ),
) -> None:
    """Run the quickstart once per seed x thread count; append the records; write the table."""
    overrides = list(overrides or [])
    label = label or " ".join([_relative(recipe), *overrides])
    host = socket.gethostname().split(".")[0]
    runs_file = runs or RESULTS_DIR / f"demo-sweep-{datetime.date.today().isoformat()}-{host}.jsonl"
    runs_file.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="rlcli-demo-sweep-") as scratch:
        root = work_dir or Path(scratch)
        for thread_count in _int_list(threads, "--threads"):
            for seed in _int_list(seeds, "--seeds"):
                output_dir = root / f"seed{seed}-threads{thread_count}"
                if output_dir.exists():
                    raise typer.BadParameter(f"{output_dir} exists: a sweep run starts fresh")
                typer.echo(f"[demo-sweep] seed {seed}, OMP_NUM_THREADS={thread_count} ...")
                record = run_demo(recipe, overrides, seed, thread_count, output_dir, label)
                with runs_file.open("a", encoding="utf-8") as handle:
                    handle.write(json.dumps(record) + "\n")
                typer.echo(f"[demo-sweep] {_summary(record)}")
    table = write_table(runs_file, [label], None)
    typer.echo(table.read_text())
    typer.echo(f"runs: {runs_file}\ntable: {table}")


@app.command()
def table(
    runs_file: Path = typer.Argument(..., help="A JSON-lines file written by `run`."),
    label: Optional[list[str]] = typer.Option(None, help="Only these labels (repeatable)."),
    output: Optional[Path] = typer.Option(None, help="Markdown file (default: RUNS_FILE.md)."),
) -> None:
    """Write the Markdown table of a runs file."""
    target = write_table(runs_file, label, output)
    typer.echo(target.read_text())


def _summary(record: dict) -> str:
    if record["returncode"] != 0:
        return f"FAILED (exit {record['returncode']}):\n{record.get('error', '')}"
    return (
        f"held-out accuracy {record['before']:.3f} -> {record['after']:.3f}; SFT "
        f"{record.get('sft_s', float('nan')):.0f} s, RL {record.get('rl_s', float('nan')):.0f} s,"
        f" total {record['total_s']:.0f} s"
    )


if __name__ == "__main__":
    app()
