"""What a benchmark run is about to do and roughly how long it will take, said before it starts:
each section's time in the newest recorded run of the same mode (the result JSONs), else, in CPU
mode, the figures of a 2-core CPU run.

    plan_lines(mode, sections, all_sections, results_dirs) -> lines to print
    recorded_seconds(mode, results_dirs) -> {section: (seconds, result file)}
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

# The full run of 2026-12-04 on a 2-core AMD EPYC (cpu mode, 1 torch thread; mismatch and
# recovery: their own runs of 2026-12-06 there), in seconds: what a CPU run is said to take when
# no run of this machine is recorded.
ROUGH_CPU_SECONDS = {"device": 3, "rollout": 43, "sync": 102, "train": 193, "lora": 25,
                     "grpo": 40, "placement": 632, "mismatch": 729, "recovery": 150}  # fmt: skip
# Starting a section's process (python, torch) and writing the report, per section.
START_SECONDS = 3


def recorded_seconds(mode: str, results_dirs: Iterable[Path]) -> dict[str, tuple[float, str]]:
    """{section: (seconds, result file name)} from the newest recorded run of `mode` that ran it."""
    records = []
    for folder in dict.fromkeys(Path(d) for d in results_dirs):  # in order, once each
        for path in folder.glob("*.json") if folder.is_dir() else ():
            try:
                record = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(record, dict) and record.get("mode") == mode:
                records.append((str(record.get("date", "")), path.stat().st_mtime, path, record))
    recorded: dict[str, tuple[float, str]] = {}
    for *_, path, record in sorted(records, key=lambda r: r[:2], reverse=True):
        for name, result in record.items():
            if name not in recorded and isinstance(result, dict) and "section_seconds" in result:
                recorded[name] = result["section_seconds"], path.name
    return recorded


def plan_lines(
    mode: str, sections: Sequence[str], all_sections: Sequence[str], results_dirs: Iterable[Path]
) -> list[str]:
    """Which sections run, about how long each and all take; which are left out and their cost."""
    recorded = recorded_seconds(mode, results_dirs)
    rough = ROUGH_CPU_SECONDS if mode == "cpu" else {}
    estimate = {
        name: recorded[name][0] if name in recorded else rough.get(name) for name in all_sections
    }
    left_out = [name for name in all_sections if name not in sections]
    count = f"{len(sections)} section{'' if len(sections) == 1 else 's'}"
    lines = [f"[benchmark] {mode} mode, {count}: {_listed(sections, estimate)}"]
    if all(estimate[name] is not None for name in sections):
        children = 1 if mode == "smoke" else len(sections)  # smoke: all in one process
        total = sum(estimate[name] for name in sections) + START_SECONDS * children
        used = [name for name in sections if name in recorded]
        files = ", ".join(dict.fromkeys(recorded[name][1] for name in used))
        if len(used) == len(sections):
            source = f"the sections' times in {files}"
        elif used:
            source = f"{', '.join(used)} as in {files}; the rest as on 2 CPU cores"
        else:
            source = "rough: the times of a full run on 2 CPU cores; none recorded here"
        lines.append(f"[benchmark] about {_duration(total)} in all ({source})")
    else:
        lines.append(f"[benchmark] no recorded {mode} run to estimate the time from")
    if left_out:
        lines.append(
            f"[benchmark] left out: {_listed(left_out, estimate)} "
            "(`make benchmark-full` / `python -m benchmarks --full` runs every section)"
        )
    return lines


def _listed(names: Sequence[str], estimate: dict[str, float | None]) -> str:
    return ", ".join(
        name if estimate[name] is None else f"{name} ~{_duration(estimate[name])}" for name in names
    )


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 100 else f"{seconds / 60:.0f} min"
