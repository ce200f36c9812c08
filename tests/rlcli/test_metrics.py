import io
import json
import math
import re
import sys

import pytest
from rich.console import Console

from rlcli.errors import UserError
from rlcli.run import metrics as metrics_module
from rlcli.run.metrics import (
    CONSOLE_COLUMNS,
    CONSOLE_WIDTH,
    MetricsLogger,
    Timer,
    _ConsoleBackend,
    console_fields,
    fit_line,
    format_eta,
    read_metrics_jsonl,
)


def test_timer_sums_repeated_phases_and_times_failing_blocks(monkeypatch):
    clock = iter([10.0, 10.5, 20.0, 21.25, 30.0, 30.125])
    monkeypatch.setattr(metrics_module.time, "perf_counter", lambda: next(clock))
    timer = Timer()
    with timer("gen"):
        pass
    with timer("gen"):
        pass
    with pytest.raises(ValueError), timer("update"):
        raise ValueError("boom")
    assert timer.metrics() == {"timing/gen": 1.75, "timing/update": 0.125}
    assert Timer().metrics() == {}


def test_jsonl_records_every_step_and_counts_non_finite_values(tmp_path):
    with pytest.warns(RuntimeWarning, match="actor/pg_loss"):
        with MetricsLogger(tmp_path, backends=("jsonl",)) as logger:
            logger.log(1, {"reward/mean": 0.25, "actor/pg_loss": -0.5})
            logger.log(2, {"reward/mean": 0.5, "actor/pg_loss": float("nan")})
            logger.log(3, {"reward/mean": 0.75, "actor/pg_loss": float("inf")})
    records = read_metrics_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["reward/mean"] for r in records] == [0.25, 0.5, 0.75]
    assert math.isnan(records[1]["actor/pg_loss"]) and records[2]["actor/pg_loss"] == math.inf
    assert logger.non_finite_counts == {"actor/pg_loss": 2}


def test_only_rank_zero_writes(tmp_path):
    run_dir = tmp_path / "run"
    logger = MetricsLogger(run_dir, backends=("jsonl", "tensorboard", "console"), rank=1)
    logger.log(1, {"reward/mean": 1.0})
    logger.close()
    assert not run_dir.exists()


def test_resumed_run_continues_the_file_without_duplicate_steps(tmp_path):
    with MetricsLogger(tmp_path, backends=("jsonl",)) as logger:
        for step in range(1, 6):
            logger.log(step, {"reward/mean": float(step)})
    # The interrupted run also left half a line behind.
    with open(tmp_path / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 6, "rew')
    # Its last checkpoint was step 3: steps 4-6 are redone by the resumed run.
    with MetricsLogger(tmp_path, backends=("jsonl",), resumed_from_step=3) as logger:
        for step in range(4, 7):
            logger.log(step, {"reward/mean": 10.0 * step})
    records = read_metrics_jsonl(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["reward/mean"]) for r in records] == [
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        (4, 40.0),
        (5, 50.0),
        (6, 60.0),
    ]


def test_appending_after_a_cut_line_starts_a_new_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "x": 1.0}\n{"step": 2, "x"')
    with MetricsLogger(tmp_path, backends=("jsonl",)) as logger:
        logger.log(3, {"x": 3.0})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[-1]) == {"step": 3, "x": 3.0}


def _tensorboard_scalars(log_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir))
    accumulator.Reload()
    return [(event.step, event.value) for event in accumulator.Scalars(tag)]


def test_tensorboard_scalars_read_back_and_resume_purges_later_steps(tmp_path):
    config = {"trainer": {"lr": 1e-5}}
    with MetricsLogger(tmp_path, backends=("tensorboard",), config_dict=config) as logger:
        for step in range(1, 5):
            logger.log(step, {"actor/grad_norm": 0.5 * step})
    with MetricsLogger(tmp_path, backends=("tensorboard",), resumed_from_step=2) as logger:
        logger.log(3, {"actor/grad_norm": 30.0})
    scalars = _tensorboard_scalars(tmp_path / "tensorboard", "actor/grad_norm")
    assert scalars == [(1, 0.5), (2, 1.0), (3, 30.0)]


STEP_METRICS = {
    "reward/score_mean": 0.375,
    "reward/accuracy": 0.4,
    "response_length/mean": 12.0,
    "actor/pg_loss": -0.0123,
    "actor/grad_norm": 1.5,
    "timing/step": 2.0,
    "perf/tokens_per_s": 2345.0,
    "not/shown": 99.0,
}


def test_console_prints_one_plain_line_per_step_when_not_a_terminal(tmp_path, capsys):
    with MetricsLogger(tmp_path, backends=("console",), total_steps=10) as logger:
        logger.log(7, STEP_METRICS)
    line = capsys.readouterr().out.strip()
    assert line.startswith("step 7/10 | eta ")  # the ETA's value is the wall time's
    assert line.endswith("| reward 0.375 | acc 0.4 | resp_len 12 | step_s 2 | tok/s 2345")
    assert len(line) <= CONSOLE_WIDTH < len(line + " | pg_loss -0.0123")


def test_console_eta_counts_only_the_steps_this_process_ran():
    """Resumed at step 4 of 10: step 5 took 2 s (its timing/step), step 6 was logged 4 s after
    step 5's start: 2 s a step, 4 steps left."""
    buffer, now = io.StringIO(), [100.0]
    pipe = Console(file=buffer, force_terminal=False, width=80)
    backend = _ConsoleBackend(pipe, total_steps=10, first_step=4, clock=lambda: now[0])
    backend.log(5, {"timing/step": 2.0})
    now[0] = 102.0
    backend.log(6, {"timing/step": 2.0})
    assert buffer.getvalue().splitlines() == [
        "step 5/10 | eta 0m10s | step_s 2",
        "step 6/10 | eta 0m08s | step_s 2",
    ]
    assert format_eta(3 * 3600 + 125) == "3h02m"


def test_console_lines_fit_100_columns_most_useful_fields_first():
    every = {key: -1.234567e-05 for _, key in CONSOLE_COLUMNS}
    fields = console_fields(every)
    assert len(fields) == len(CONSOLE_COLUMNS) and fields[0].startswith("reward ")
    line = fit_line(["step 100000/100000", "eta 12h34m", *fields])
    assert len(line) <= CONSOLE_WIDTH and line.startswith("step 100000/100000 | eta 12h34m | ")
    assert line.endswith(fields[len(line.split(" | ")) - 3])  # whole fields, cut at a boundary
    assert "grad_norm" not in line  # the last fields give way


def test_console_shows_a_progress_bar_on_a_terminal(tmp_path):
    buffer = io.StringIO()
    terminal = Console(file=buffer, force_terminal=True, width=160, color_system=None)
    with MetricsLogger(
        tmp_path, backends=("console",), total_steps=4, console=terminal, resumed_from_step=1
    ) as logger:
        for step in range(2, 5):
            logger.log(step, {**STEP_METRICS, "reward/score_mean": step / 4})
    output = buffer.getvalue()
    assert "4/4" in output and "reward 1" in output
    lines = re.findall(r"step \d/4 \| [^\r\n]*", output)  # the step lines above the bar
    assert [line.split(" | ")[0] for line in lines] == ["step 2/4", "step 3/4", "step 4/4"]
    assert all(len(line) <= CONSOLE_WIDTH for line in lines)


def test_wandb_chosen_but_missing_names_the_config_key(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    with pytest.raises(UserError, match=r"logging\.backends.*pip install .rlcli\[wandb\]."):
        MetricsLogger(tmp_path, backends=("console", "wandb"))


def test_wandb_chosen_but_missing_fails_at_config_time(monkeypatch):
    from rlcli.validation.loader import load_config
    from rlcli.validation.validate import validate
    from tests.rlcli.test_cli_errors import QUICKSTART

    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(UserError, match=r"pip install .rlcli\[wandb\]."):
        validate(load_config(QUICKSTART, ["logging.backends=[console,wandb]"]))


def test_unknown_backend_lists_the_valid_ones(tmp_path):
    with pytest.raises(UserError, match="logging.backends.*'mlflow'.*console, tensorboard"):
        MetricsLogger(tmp_path, backends=("mlflow",))


def test_wandb_offline_writes_the_metrics_and_a_resume_continues_the_same_run(
    tmp_path, monkeypatch
):
    """The real wandb package, offline (what a cluster without internet runs, `wandb sync`
    later): each run's records hold its metrics and the config; a run resumed from a checkpoint
    writes to the same W&B run id, a fresh run in the folder to a new one. (The offline record
    file is W&B's own binary format; the checks look for the values' bytes in it.)"""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = {"actor": {"lr": 0.015625}}

    def run(steps: dict[int, float], resumed_from_step: int | None) -> str:
        logger = MetricsLogger(
            tmp_path, backends=("wandb",), project="rlcli-test", experiment="offline",
            config_dict=config, resumed_from_step=resumed_from_step,
        )  # fmt: skip
        for step, reward in steps.items():
            logger.log(step, {"reward/mean": reward})
        logger.close()
        return (tmp_path / "wandb_run_id").read_text().strip()

    first = run({1: 0.25, 2: 0.375}, None)
    resumed = run({3: 0.8125}, 2)
    fresh = run({1: 0.4375}, None)
    assert resumed == first != fresh
    records: dict[str, list[bytes]] = {}
    for folder in (tmp_path / "wandb").glob("offline-run-*"):
        run_id = folder.name.rsplit("-", 1)[1]
        records.setdefault(run_id, []).append(next(folder.glob("run-*.wandb")).read_bytes())
    assert sorted(map(len, records.values())) == [1, 2] and set(records) == {first, fresh}
    everything = [r for rs in records.values() for r in rs]
    assert all(b"reward/mean" in r and b"0.015625" in r for r in everything)
    first_run = sorted(records[first], key=lambda r: b"0.8125" in r)
    assert b"0.375" in first_run[0] and b"0.8125" not in first_run[0]
    assert b"0.8125" in first_run[1]  # the resumed part
    assert b"0.4375" in records[fresh][0]
