"""``rlcli plot RUN_DIR [--output PNG]``: training curves as one PNG from ``RUN_DIR/metrics.jsonl``,
so a user sees how a run went without TensorBoard (or from a copied metrics file).

One panel per topic (reward and accuracy, held-out accuracy, losses, KL, phase timing, trainer vs
engine log-prob difference); a panel whose metrics the run never logged is left out.

Mounted by rlcli.cli as ``app.command("plot")(plot_command)``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

import typer

from rlcli.errors import UserError

# (panel title, metric keys drawn in it, log-scale y axis)
# Panels whose curves are exactly zero at every step when their term is not used (no KL in the
# loss or the reward, no KL loss): such a curve is left out, and the panel with it when it is empty.
ZERO_MEANS_UNUSED = ("losses", "KL")
PANELS: tuple[tuple[str, tuple[str, ...], bool], ...] = (
    ("reward (training rollouts)", ("reward/score_mean", "reward/accuracy"), False),
    ("held-out accuracy", ("val/reward/accuracy", "val/reward/score_mean"), False),
    (
        "losses",
        ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "critic/vf_loss", "sft/loss"),
        False,
    ),
    (
        "KL",
        (
            "actor/ppo_kl",
            "actor/kl_to_ref",
            "algorithm/kl",
            "algorithm/kl_coef",
            "distill/reverse_kl",  # to the distillation teacher, per token
            "actor/distill_loss",  # the top-k objective's KL to the teacher
        ),
        False,
    ),
    (
        "seconds per phase",
        (
            "timing/step",
            "timing/gen",
            "timing/old_log_prob",
            "timing/ref",
            "timing/teacher",
            "timing/values",
            "timing/update",
            "timing/update_critic",
            "timing/sync",
        ),
        False,
    ),
    (
        "trainer vs engine log-prob diff",
        ("rollout/logprob_diff_max", "rollout/logprob_diff_mean"),
        True,
    ),
)


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics.jsonl (one JSON object per line with a "step")."""
    if not path.is_file():
        raise UserError(f"{path}: no such file (a run writes it when logging.backends has 'jsonl')")
    records = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError(f"{path}:{lineno}: not a JSON line ({err.msg})") from None
        if not isinstance(record, dict) or "step" not in record:
            raise UserError(f'{path}:{lineno}: a metrics record needs a "step"')
        records.append(record)
    if not records:
        raise UserError(f"{path}: no metrics yet (the run has not finished a step)")
    return records


def _series(records: list[dict], key: str) -> tuple[list[float], list[float]]:
    steps, values = [], []
    for record in records:
        value = record.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value):
            steps.append(record["step"])
            values.append(float(value))
    return steps, values


def _moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to `window` points (the first points average what exists)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_metrics(records: list[dict], output: Path, title: str) -> list[str]:
    """Write the curves to `output` (PNG); returns the panel titles drawn."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    panels = []
    for name, keys, log_y in PANELS:
        lines = [(key, *_series(records, key)) for key in keys]
        lines = [line for line in lines if line[1]]
        if name in ZERO_MEANS_UNUSED:
            lines = [line for line in lines if any(v != 0 for v in line[2])]
        if lines:
            panels.append((name, lines, log_y))
    if not panels:
        raise UserError(
            f"{title}: none of the plotted metrics were logged ({PANELS[0][1][0]}, ...)"
        )
    cols = 2 if len(panels) > 1 else 1
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 3.6 * rows), squeeze=False)
    for ax, (name, lines, log_y) in zip(axes.flat, panels, strict=False):
        for key, steps, values in lines:
            if len(steps) < 60:
                # A single point (e.g. one validation) would be invisible as a line.
                ax.plot(steps, values, label=key, marker="o", ms=3)
                continue
            # Long runs: per-step values faint, their moving average on top.
            (raw,) = ax.plot(steps, values, alpha=0.25, lw=0.8)
            ax.plot(
                steps, _moving_average(values, len(values) // 30), color=raw.get_color(), label=key
            )
        if log_y and all(v > 0 for _, _, vs in lines for v in vs):
            ax.set_yscale("log")
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(title)
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=100)
    plt.close(fig)
    return [name for name, _, _ in panels]


def plot_command(
    run_dir: Path = typer.Argument(..., help="A run's output directory (holds metrics.jsonl)."),
    output: Optional[Path] = typer.Option(
        None, "--output", "-o", help="PNG to write (default: RUN_DIR/curves.png)."
    ),
):
    """Plot a run's curves (reward, held-out accuracy, losses, KL, timing) as one PNG."""
    from rlcli.run.metrics import METRICS_FILE_NAME

    metrics_file = run_dir / METRICS_FILE_NAME if run_dir.is_dir() else run_dir
    records = read_metrics(metrics_file)
    output = output or metrics_file.parent / "curves.png"
    if output.suffix.lower() != ".png":
        raise UserError(f"--output {output}: the plot is written as PNG; name it *.png")
    panels = plot_metrics(records, output, title=str(metrics_file.parent))
    typer.echo(f"wrote {output} ({len(records)} records; {', '.join(panels)})")
