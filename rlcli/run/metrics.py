"""Training metrics: per-phase timers and one logger that writes
to the console, TensorBoard, a JSON-lines file and (optionally) Weights & Biases.

Only rank 0 writes anything; other ranks may call the same methods, which do nothing, so the
trainer needs no ``if rank == 0`` around logging.
"""

from __future__ import annotations

import io
import json
import math
import os
import sys
import time
import uuid
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from rlcli.config.schema import LoggingConfig, choices
from rlcli.errors import UserError

VALID_BACKENDS = choices(LoggingConfig, "backends")
METRICS_FILE_NAME = "metrics.jsonl"
WANDB_RUN_ID_FILE = "wandb_run_id"  # the W&B run a resumed run continues
TENSORBOARD_DIR_NAME = "tensorboard"

# What the console shows per step, the most useful first: (label, metric key). A column whose key a
# step's metrics do not have is left out; the line ends before the first field that would not fit
# in CONSOLE_WIDTH columns (every metric is in metrics.jsonl and TensorBoard).
CONSOLE_COLUMNS: tuple[tuple[str, str], ...] = (
    ("reward", "reward/score_mean"),
    ("acc", "reward/accuracy"),
    ("val_acc", "val/reward/accuracy"),
    ("resp_len", "response_length/mean"),
    ("step_s", "timing/step"),
    ("tok/s", "perf/tokens_per_s"),
    ("lp_diff", "rollout/logprob_diff_max"),
    ("pg_loss", "actor/pg_loss"),
    ("grad_norm", "actor/grad_norm"),
)
CONSOLE_WIDTH = 100


class Timer:
    """Accumulates wall-clock seconds per phase name.

    ``with timer("gen"): ...`` adds the block's duration to ``timing/gen``; a phase entered twice
    in one step is summed; the trainer makes one Timer per step.
    """

    def __init__(self) -> None:
        self._seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self._seconds[phase] += time.perf_counter() - start

    def add(self, phase: str, seconds: float) -> None:
        """Count ``seconds`` (measured elsewhere) towards ``phase``."""
        self._seconds[phase] += seconds

    def metrics(self) -> dict[str, float]:
        """``{"timing/<phase>": seconds}`` accumulated so far."""
        return {f"timing/{phase}": seconds for phase, seconds in self._seconds.items()}


def _format_value(value: float) -> str:
    if not math.isfinite(value):
        return str(value)
    if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
        return f"{value:.3e}"
    if float(value).is_integer() and abs(value) < 1e5:
        return str(int(value))
    return f"{value:.4g}"


def console_fields(metrics: Mapping[str, float]) -> list[str]:
    """The ``label value`` fields the console shows for one step, in CONSOLE_COLUMNS order."""
    return [
        f"{label} {_format_value(float(metrics[key]))}"
        for label, key in CONSOLE_COLUMNS
        if key in metrics
    ]


def fit_line(fields: Sequence[str], width: int = CONSOLE_WIDTH) -> str:
    """``fields`` joined by `` | ``, ending before the first one that would pass ``width``."""
    line = ""
    for field_text in fields:
        longer = f"{line} | {field_text}" if line else field_text
        if len(longer) > width:
            break
        line = longer
    return line


def format_eta(seconds: float) -> str:
    minutes, seconds = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{seconds:02d}s"


class _ConsoleBackend:
    """One line per step of at most CONSOLE_WIDTH columns: ``step 46/80 | eta 3m40s | reward ...``.
    The ETA counts the steps this process ran (a resumed run's earlier steps are not its own).
    On a terminal a rich progress bar (steps, elapsed, remaining) stays below the lines."""

    def __init__(
        self,
        console: Console,
        total_steps: int | None,
        first_step: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._console = console
        self._clock = clock
        self._total_steps = total_steps
        self._first_step = first_step
        self._started: float | None = None  # when the first step after `first_step` began
        self._progress: Progress | None = None
        self._task: TaskID | None = None

    def _eta(self, step: int) -> float | None:
        if not self._total_steps or self._started is None or step <= self._first_step:
            return None
        per_step = (self._clock() - self._started) / (step - self._first_step)
        return per_step * (self._total_steps - step)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if self._started is None:
            # The first record's step ran before it was logged: count from there (step 0 is the
            # evaluation before RL, whose time is not a step's).
            duration = metrics.get("timing/step", 0.0) if step > self._first_step else 0.0
            self._started = self._clock() - duration
        total = f"/{self._total_steps}" if self._total_steps else ""
        eta = self._eta(step)
        head = [f"step {step}{total}"] + ([f"eta {format_eta(eta)}"] if eta is not None else [])
        width = min(CONSOLE_WIDTH, self._console.width) if self._console.is_terminal else None
        line = fit_line(head + console_fields(metrics), width or CONSOLE_WIDTH)
        if not self._console.is_terminal:
            self._console.print(line, highlight=False, soft_wrap=True)
            return
        if self._progress is None:
            self._progress = Progress(
                TextColumn("[bold]step"),
                MofNCompleteColumn(),
                BarColumn(bar_width=30),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=self._console,
            )
            self._progress.start()
            self._task = self._progress.add_task(
                "train", total=self._total_steps, completed=self._first_step
            )
        assert self._task is not None
        self._progress.console.print(line, highlight=False, soft_wrap=True)
        self._progress.update(self._task, completed=step)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def wandb_missing_message() -> str:
    return (
        "logging.backends includes 'wandb' but the wandb package is not installed: run "
        "`pip install 'rlcli[wandb]'` (or `pip install wandb`), or remove 'wandb' from "
        f"logging.backends (valid backends: {', '.join(VALID_BACKENDS)})."
    )


def _start_wandb_run(
    output_dir: Path,
    project: str,
    experiment: str,
    config_dict: Mapping[str, Any] | None,
    resumed: bool,
) -> Any:
    """A W&B run whose files go under ``output_dir/wandb``. Its id is kept in
    ``output_dir/wandb_run_id``: a run resumed from a checkpoint continues that W&B run (online,
    or offline with ``WANDB_MODE=offline`` and ``wandb sync`` later); a fresh run in the folder
    (``trainer.resume=none``) starts a new one. W&B ignores steps at or below the last one it
    holds, so steps an interrupted run logged after its checkpoint keep their first values."""
    try:
        import wandb
    except ImportError as error:
        raise UserError(wandb_missing_message()) from error
    id_file = output_dir / WANDB_RUN_ID_FILE
    run_id = id_file.read_text().strip() if resumed and id_file.is_file() else ""
    if not run_id:
        run_id = uuid.uuid4().hex[:12]  # W&B run ids: letters, digits, unique per project
        id_file.write_text(run_id + "\n")
    return wandb.init(
        project=project,
        name=experiment,
        id=run_id,
        config=dict(config_dict or {}),
        dir=str(output_dir),
        resume="allow",
    )


class MetricsLogger:
    """Writes one dict of scalar metrics per training step to the chosen backends.

    Args:
        output_dir: run directory; ``metrics.jsonl`` and ``tensorboard/`` go here.
        backends: any of ``console``, ``tensorboard``, ``jsonl``, ``wandb``.
        project, experiment: names for wandb (and the console header).
        config_dict: the resolved run config, recorded in TensorBoard text and wandb.
        total_steps: length of the progress bar; ``None`` for an open-ended run.
        rank: global rank; every rank but 0 writes nothing.
        resumed_from_step: when a run resumes from a checkpoint of this step, records written
            after that step by the interrupted run are dropped (jsonl and TensorBoard), so every
            step appears once.
        console: where the console backend prints (default: stdout).
    """

    def __init__(
        self,
        output_dir: str | os.PathLike[str],
        backends: Sequence[str] = ("console", "tensorboard", "jsonl"),
        project: str = "rlcli",
        experiment: str = "run",
        config_dict: Mapping[str, Any] | None = None,
        total_steps: int | None = None,
        rank: int = 0,
        resumed_from_step: int | None = None,
        console: Console | None = None,
    ) -> None:
        unknown = [name for name in backends if name not in VALID_BACKENDS]
        if unknown:
            raise UserError(
                f"logging.backends has unknown backend(s) {unknown}; "
                f"valid backends: {', '.join(VALID_BACKENDS)}."
            )
        self.output_dir = Path(output_dir)
        self.rank = rank
        # Counts of NaN / inf values per metric key; they are still logged, as is.
        self.non_finite_counts: dict[str, int] = defaultdict(int)
        self._jsonl_file: io.TextIOWrapper | None = None
        self._tensorboard: Any = None
        self._wandb_run: Any = None
        self._console_backend: _ConsoleBackend | None = None
        if rank != 0:
            return

        self.output_dir.mkdir(parents=True, exist_ok=True)
        if "wandb" in backends:
            self._wandb_run = _start_wandb_run(
                self.output_dir, project, experiment, config_dict, resumed_from_step is not None
            )
        if "jsonl" in backends:
            jsonl_path = self.output_dir / METRICS_FILE_NAME
            if resumed_from_step is not None:
                _drop_records_after(jsonl_path, resumed_from_step)
            _end_with_newline(jsonl_path)
            self._jsonl_file = open(jsonl_path, "a", encoding="utf-8")
        if "tensorboard" in backends:
            from torch.utils.tensorboard import SummaryWriter

            purge_step = None if resumed_from_step is None else resumed_from_step + 1
            self._tensorboard = SummaryWriter(
                log_dir=str(self.output_dir / TENSORBOARD_DIR_NAME), purge_step=purge_step
            )
            if config_dict is not None:
                config_text = json.dumps(config_dict, indent=2, default=str)
                self._tensorboard.add_text("config", f"```\n{config_text}\n```", global_step=0)
        if "console" in backends:
            self._console_backend = _ConsoleBackend(
                console or Console(), total_steps, first_step=resumed_from_step or 0
            )

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record ``metrics`` (scalars, or 0-d tensors) for training step ``step``."""
        if self.rank != 0:
            return
        values = {key: float(value) for key, value in metrics.items()}
        for key, value in values.items():
            if not math.isfinite(value):
                if self.non_finite_counts[key] == 0:
                    warnings.warn(
                        f"metric {key!r} is {value} at step {step}", RuntimeWarning, stacklevel=2
                    )
                self.non_finite_counts[key] += 1
        if self._jsonl_file is not None:
            # Python's json writes NaN / Infinity for non-finite floats, which json.loads reads.
            self._jsonl_file.write(json.dumps({"step": step, **values}) + "\n")
            self._jsonl_file.flush()
        if self._tensorboard is not None:
            for key, value in values.items():
                self._tensorboard.add_scalar(key, value, global_step=step)
        if self._wandb_run is not None:
            self._wandb_run.log(values, step=step)
        if self._console_backend is not None:
            self._console_backend.log(step, values)

    def close(self) -> None:
        """Flush and close every backend; reports metrics that had non-finite values."""
        if self._console_backend is not None:
            self._console_backend.close()
            self._console_backend = None
        if self._jsonl_file is not None:
            self._jsonl_file.close()
            self._jsonl_file = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None
        if self.rank == 0 and self.non_finite_counts:
            counts = ", ".join(f"{k}: {n}" for k, n in sorted(self.non_finite_counts.items()))
            print(f"non-finite metric values (steps per key): {counts}", file=sys.stderr)

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def read_metrics_jsonl(path: str | os.PathLike[str]) -> list[dict[str, float]]:
    """The records of a ``metrics.jsonl`` file, in order (each has a ``step`` key)."""
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _drop_records_after(path: Path, last_step: int) -> None:
    """Rewrite ``path`` without records of steps after ``last_step`` (atomically)."""
    if not path.exists():
        return
    kept = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            # A line cut short by a crash is not valid JSON; drop it with the later steps.
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record.get("step", -1) <= last_step:
                kept.append(line if line.endswith("\n") else line + "\n")
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text("".join(kept), encoding="utf-8")
    os.replace(temporary, path)


def _end_with_newline(path: Path) -> None:
    """Terminate a last line cut short by a crash, so appended records start on their own line."""
    if not path.exists() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as handle:
        handle.seek(-1, os.SEEK_END)
        if handle.read(1) != b"\n":
            handle.write(b"\n")
