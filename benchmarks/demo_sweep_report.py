"""The quickstart sweep's runs (benchmarks/demo_sweep.py records) as Markdown:

    sweep_markdown(runs) -> str

One overview row per configuration (label) when there are several, then per configuration: the
machine, one row per run (the held-out curve, the error left, the wall times) and the min /
median / max of each figure. "Error left" is the held-out error after RL as a share of the
error after SFT: at most 0.5 means the run at least halved the SFT start's error rate.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from rlcli.machine import format_duration

HALVED = 0.5


def error_left(run: dict) -> float | None:
    """(1 - after) / (1 - before); None for a failed run or a start with no error left."""
    before, after = run.get("before"), run.get("after")
    if before is None or after is None or before >= 1.0:
        return None
    return (1.0 - after) / (1.0 - before)


def sweep_markdown(runs: list[dict]) -> str:
    labels = list(dict.fromkeys(run["label"] for run in runs))
    lines: list[str] = []
    if len(labels) > 1:
        lines += _overview(runs, labels) + [""]
    for label in labels:
        lines += _configuration([run for run in runs if run["label"] == label]) + [""]
    return "\n".join(lines)


def _ok(runs: list[dict]) -> list[dict]:
    return [run for run in runs if run["returncode"] == 0 and run.get("after") is not None]


def _spread(values: list[float], show: Callable[[float], str]) -> str:
    if not values:
        return "n/a"
    low, mid, high = min(values), statistics.median(values), max(values)
    return f"{show(low)} / {show(mid)} / {show(high)}"


def _pct(value: float) -> str:
    return f"{100 * value:.1f}%"


def _ratio(value: float) -> str:
    return f"{value:.2f}"


def _halved(runs: list[dict]) -> str:
    left = [error_left(run) for run in _ok(runs)]
    count = sum(1 for value in left if value is not None and value <= HALVED)
    return f"{count} of {len(runs)}"


def _overview(runs: list[dict], labels: list[str]) -> list[str]:
    lines = [
        "| configuration | runs | after SFT (min / median / max) | after RL | error left "
        "(worst) | halved the error | total time (median) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for label in labels:
        group = [run for run in runs if run["label"] == label]
        ok = _ok(group)
        left = [value for value in map(error_left, ok) if value is not None]
        totals = [run["total_s"] for run in ok]
        lines.append(
            f"| `{label}` | {len(group)} | {_spread([r['before'] for r in ok], _pct)} | "
            f"{_spread([r['after'] for r in ok], _pct)} | "
            f"{_ratio(max(left)) if left else 'n/a'} | {_halved(group)} | "
            f"{format_duration(statistics.median(totals)) if totals else 'n/a'} |"
        )
    return lines


def _configuration(runs: list[dict]) -> list[str]:
    first = runs[0]
    ok = _ok(runs)
    cpus = sorted({run["cpu"] for run in runs})
    commits = sorted({str(run.get("commit")) for run in runs})
    loads = [run["load_average_start"][0] for run in runs]
    steps = sorted({int(s) for run in ok for s in run["curve"]} - {0})
    lines = [
        f"### `{first['label']}`",
        "",
        f"{len(runs)} runs of `{' '.join(['rlcli train', first['recipe'], *first['overrides']])}` "
        f"(seed x OMP_NUM_THREADS) on {', '.join(cpus)} "
        f"(host {first['host']}), commit {', '.join(commits)}, {first['date'][:10]}; 1-minute "
        f"load average at the runs' starts {min(loads):.2f}-{max(loads):.2f}. Runs that at least "
        f"halved the SFT start's held-out error: {_halved(runs)}.",
        "",
        "| seed | threads | after SFT | "
        + " | ".join(f"step {s}" for s in steps)
        + " | error left | SFT | RL | total | median step | load start -> end |",
        "| --- | --- | --- | " + "--- | " * len(steps) + "--- | --- | --- | --- | --- | --- |",
    ]
    for run in sorted(runs, key=lambda r: (r["threads"], r["seed"])):
        if run not in ok:
            lines.append(
                f"| {run['seed']} | {run['threads']} | failed (exit {run['returncode']}) |"
                + " |" * (len(steps) + 6)
            )
            continue
        curve = [run["curve"].get(str(s)) for s in steps]
        left = error_left(run)
        lines.append(
            f"| {run['seed']} | {run['threads']} | {_pct(run['before'])} | "
            + " | ".join("" if value is None else _pct(value) for value in curve)
            + f" | {'n/a' if left is None else _ratio(left)} | {_seconds(run.get('sft_s'))} | "
            f"{_seconds(run.get('rl_s'))} | {format_duration(run['total_s'])} | "
            f"{_step(run.get('median_step_s'))} | {_load(run)} |"
        )
    lines += ["", "| figure | min / median / max |", "| --- | --- |"]
    rows: list[tuple[str, list[float], Callable[[float], str]]] = [
        ("held-out accuracy after SFT (before RL)", [r["before"] for r in ok], _pct),
        ("held-out accuracy after RL", [r["after"] for r in ok], _pct),
        ("error left (after / before)", [v for v in map(error_left, ok) if v is not None], _ratio),
        ("SFT wall time", [r["sft_s"] for r in ok if "sft_s" in r], format_duration),
        ("RL wall time", [r["rl_s"] for r in ok if "rl_s" in r], format_duration),
    ]
    for threads in sorted({run["threads"] for run in ok}):
        totals = [run["total_s"] for run in ok if run["threads"] == threads]
        rows.append((f"total wall time, {threads} thread(s)", totals, format_duration))
    lines += [f"| {name} | {_spread(values, show)} |" for name, values, show in rows]
    return lines


def _load(run: dict) -> str:
    """The 1-minute load average when the run started and ended: on a shared machine the
    wall times mean little without it (2 OpenMP threads on 2 busy cores run several times
    slower)."""
    end = run.get("load_average_end")
    return f"{run['load_average_start'][0]:.2f} -> {'n/a' if not end else f'{end[0]:.2f}'}"


def _seconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f} s"


def _step(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f} s"
