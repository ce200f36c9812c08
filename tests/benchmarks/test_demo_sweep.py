"""`make demo-sweep` (benchmarks/demo_sweep.py): what it reads from a run and how it sums a sweep up.

The figures are checked against hand-worked runs; nothing here trains (the quickstart's own path
is covered end to end by tests/rlcli/test_train_e2e.py and the docs check of docs/quickstart.md).
"""

from __future__ import annotations

import json

import pytest

from benchmarks.demo_sweep import accuracies
from benchmarks.demo_sweep_report import error_left, sweep_markdown


def _run(seed: int, threads: int, before: float, after: float, total: float, **extra) -> dict:
    return {
        "label": "candidate",
        "recipe": "recipes/quickstart.yaml",
        "overrides": ["sft.steps=450"],
        "seed": seed,
        "threads": threads,
        "cpu": "Some CPU",
        "host": "box",
        "date": "2026-12-01T10:00:00",
        "commit": "abc1234",
        "load_average_start": [0.5, 0.5, 0.5],
        "load_average_end": [1.25, 0.75, 0.5],
        "returncode": 0,
        "before": before,
        "after": after,
        "curve": {"0": before, "100": (before + after) / 2, "200": after},
        "sft_s": 40.0,
        "rl_s": total - 50.0,
        "total_s": total,
        "median_step_s": 0.15,
        **extra,
    }


def test_error_left_is_the_share_of_the_start_error_that_remains():
    assert error_left(_run(1, 1, before=0.5, after=0.8, total=100)) == pytest.approx(0.4)
    assert error_left(_run(1, 1, before=0.6, after=0.7, total=100)) == pytest.approx(0.75)
    assert error_left(_run(1, 1, before=1.0, after=1.0, total=100)) is None  # nothing to halve
    assert error_left({"before": None, "after": None}) is None  # a failed run


def test_table_gives_each_run_and_the_min_median_max():
    runs = [
        _run(1, 1, before=0.5, after=0.8, total=150),  # error 0.5 -> 0.2: halved
        _run(2, 1, before=0.6, after=0.7, total=170),  # 0.4 -> 0.3: not halved
        _run(1, 2, before=0.4, after=1.0, total=110),  # 0.6 -> 0: halved
        {**_run(2, 2, 0.0, 0.0, 0), "returncode": 1, "before": None, "after": None},
    ]
    text = sweep_markdown(runs)
    assert (
        "4 runs of `rlcli train recipes/quickstart.yaml sft.steps=450` (seed x OMP_NUM_THREADS) "
        "on Some CPU (host box), commit abc1234, 2026-12-01" in text
    )
    assert "halved the SFT start's held-out error: 2 of 4." in text
    assert "| held-out accuracy after SFT (before RL) | 40.0% / 50.0% / 60.0% |" in text
    assert "| held-out accuracy after RL | 70.0% / 80.0% / 100.0% |" in text
    assert "| error left (after / before) | 0.00 / 0.40 / 0.75 |" in text
    assert "| total wall time, 1 thread(s) | 2 min 30 s / 2 min 40 s / 2 min 50 s |" in text
    assert "| total wall time, 2 thread(s) | 1 min 50 s / 1 min 50 s / 1 min 50 s |" in text
    assert "| 2 | 2 | failed (exit 1) |" in text
    rows = [line for line in text.splitlines() if line.startswith("| 1 | 1 |")]
    assert rows == [
        "| 1 | 1 | 50.0% | 65.0% | 80.0% | 0.40 | 40 s | 100 s | 2 min 30 s | 0.150 s | 0.50 -> 1.25 |"
    ]


def test_several_configurations_get_one_overview_row_each():
    runs = [
        _run(1, 1, before=0.5, after=0.8, total=150),
        {**_run(1, 1, before=0.2, after=0.4, total=200), "label": "other"},
    ]
    overview = sweep_markdown(runs).split("###")[0]
    assert (
        "| `candidate` | 1 | 50.0% / 50.0% / 50.0% | 80.0% / 80.0% / 80.0% | 0.40 | 1 of 1 |"
        in (overview)
    )
    assert "| `other` | 1 | 20.0% / 20.0% / 20.0% | 40.0% / 40.0% / 40.0% | 0.75 | 0 of 1 |" in (
        overview
    )


def test_accuracies_come_from_step_0_and_the_last_evaluation(tmp_path):
    records = [
        {"step": 0, "val/reward/accuracy": 0.25},
        {"step": 1, "timing/step": 0.2},
        {"step": 2, "timing/step": 0.4, "val/reward/accuracy": 0.5},
        {"step": 3, "timing/step": 0.3, "val/reward/accuracy": 0.75},
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    assert accuracies(path) == {
        "before": 0.25,
        "after": 0.75,
        "curve": {"0": 0.25, "2": 0.5, "3": 0.75},
        "median_step_s": 0.3,
    }
