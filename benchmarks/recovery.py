"""The benchmark's recovery section: how long a run takes to come back from a lost rank.

A real ``rlcli train --nproc 2 --max-restarts 1`` of the quickstart recipe, a checkpoint after
every step (so at most the step in flight is lost). Once step ``KILL_AFTER_STEP`` is logged and
its checkpoint is complete, this process SIGKILLs rank 1 (the way a crashed or OOM-killed worker
goes), then watches the run's output and metrics (polled every 20 ms) until the next step is
logged. The time from the kill to that step, split by what the run prints:

- detection + restart: the kill -> the first new worker process (torchrun noticing the dead
  worker, stopping the rest of the group, starting a new one: the new processes' creation times);
- imports: -> the restarted rank 0 printing "building actor" (each new process importing the
  training stack and joining the process group);
- start-up: "building actor" -> "resumed from step N" (model build, checkpoint load, engine
  start, the weight sync that gives the engine the resumed weights);
- lost step: "resumed from step N" -> the next step logged (its rollouts, update and sync again).

Each run repeats it ``recovery_runs`` times (a fresh run each time); the table gives the median
and the range.
"""

from __future__ import annotations

import importlib.util
import json
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil

from benchmarks.lifetime import stop_group
from benchmarks.placement import QUICKSTART_RECIPE, REPO_ROOT, run_environment
from benchmarks.workload import Workload

KILL_AFTER_STEP = 2
PHASES = ("detect_restart_s", "imports_s", "startup_s", "lost_step_s")
COMMON = [
    "sft.steps=0",
    # every step updates and syncs (a random model's groups all score alike: DAPO would drop them)
    "algorithm.dynamic_sampling.enabled=false",
    "trainer.val_before_train=false",
    "trainer.val_freq=0",
    "checkpoint.save_freq=1",
    "checkpoint.save_optimizer=true",
    "logging.backends=[jsonl]",
]


def recovery_section(workload: Workload, work_dir: Path) -> dict:
    engine = workload.recovery_engine or (
        "vllm" if importlib.util.find_spec("vllm") is not None else "hf"
    )
    overrides = [*COMMON, f"rollout.engine={engine}", *workload.recovery_overrides]
    runs = [
        _one_recovery(work_dir / "recovery" / f"run{i}", overrides)
        for i in range(workload.recovery_runs)
    ]
    totals = [run["total_s"] for run in runs]
    return {
        "recipe": str(QUICKSTART_RECIPE.relative_to(REPO_ROOT)),
        "engine": engine,
        "overrides": overrides,
        "runs": runs,
        "median_total_s": statistics.median(totals),
        "median": {phase: statistics.median(run[phase] for run in runs) for phase in PHASES},
    }


def _one_recovery(out: Path, overrides: list[str]) -> dict:
    out.parent.mkdir(parents=True, exist_ok=True)
    env = {**run_environment(), "PYTHONUNBUFFERED": "1"}
    total_steps = KILL_AFTER_STEP + 2
    command = [
        sys.executable, "-m", "rlcli.cli", "train", "--nproc", "2", "--max-restarts", "1",
        str(QUICKSTART_RECIPE), f"trainer.output_dir={out}", f"trainer.total_steps={total_steps}",
        *overrides,
    ]  # fmt: skip
    log = out.with_suffix(".log")
    with open(log, "w") as handle:
        run = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=handle,
                               stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        try:
            return _watch(run, out, log)
        finally:
            if run.poll() is None:
                stop_group(run)


def _watch(run: subprocess.Popen, out: Path, log: Path, timeout_s: float = 900) -> dict:
    deadline = time.monotonic() + timeout_s
    marks: dict[str, float] = {}
    checkpoint = out / "checkpoints" / f"step_{KILL_AFTER_STEP:06d}" / "COMPLETE"
    while time.monotonic() < deadline:
        now = time.monotonic()
        if "kill" not in marks and checkpoint.exists() and _steps(out) >= KILL_AFTER_STEP:
            killed = _kill_rank(run, local_rank=1)
            marks["kill"] = now
            old_workers = _workers(run)
            printed_before = log.read_text(errors="replace").count("building actor")
        if "kill" in marks:
            if "restart" not in marks:
                new = [p for p in _workers(run) if p not in old_workers and p.pid != killed]
                if new:  # its creation time, on this process's clock
                    marks["restart"] = now - (time.time() - min(p.create_time() for p in new))
            text = log.read_text(errors="replace")
            if "build" not in marks and text.count("building actor") > printed_before:
                marks["build"] = now
            if "ready" not in marks and f"resumed from step {KILL_AFTER_STEP}" in text:
                marks["ready"] = now
            if _steps(out) > KILL_AFTER_STEP:
                marks["step"] = now
                break
        if run.poll() is not None:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
            raise RuntimeError(f"the run ended (code {run.returncode}) before recovering:\n{tail}")
        time.sleep(0.02)
    else:
        raise RuntimeError(f"no recovery within {timeout_s:.0f} s (marks {marks}); see {log}")
    run.wait(timeout=timeout_s)
    if {"restart", "build", "ready"} - set(marks):
        raise RuntimeError(f"no new workers, or no 'building actor' / 'resumed' after ({log})")
    return {
        "total_s": marks["step"] - marks["kill"],
        "detect_restart_s": marks["restart"] - marks["kill"],
        "imports_s": marks["build"] - marks["restart"],
        "startup_s": marks["ready"] - marks["build"],
        "lost_step_s": marks["step"] - marks["ready"],
        "exit_code": run.returncode,
    }


def _steps(out: Path) -> int:
    path = out / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = []
    for line in path.read_text().splitlines():
        try:
            steps.append(json.loads(line).get("step", 0))
        except json.JSONDecodeError:  # the line being written
            continue
    return max(steps, default=0)


def _local_rank(process: psutil.Process) -> str | None:
    """The LOCAL_RANK of a rank torchrun runs: from the environment it was started with, or for a
    rank forked from torchrun's forkserver (``rlcli.commands.relaunch``) from the process name it
    gives itself (``rlcli-rank1``); None for any other process."""
    name = process.name()
    if name.startswith("rlcli-rank"):
        return name.removeprefix("rlcli-rank")
    return process.environ().get("LOCAL_RANK")


def _workers(run: subprocess.Popen) -> dict[psutil.Process, str]:
    """The rank processes torchrun runs now, with their LOCAL_RANK."""
    workers = {}
    for child in psutil.Process(run.pid).children(recursive=True):
        try:
            local_rank = _local_rank(child)
            if local_rank is not None and child.status() != psutil.STATUS_ZOMBIE:
                workers[child] = local_rank
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return workers


def _kill_rank(run: subprocess.Popen, local_rank: int) -> int:
    """SIGKILL the worker torchrun runs with LOCAL_RANK `local_rank`; its pid."""
    for worker, rank in _workers(run).items():
        if rank == str(local_rank):
            try:
                worker.send_signal(signal.SIGKILL)
                return worker.pid
            except psutil.NoSuchProcess:
                continue
    raise RuntimeError(f"no rank with LOCAL_RANK={local_rank} under the run's torchrun")


def recovery_table(recovery: dict | None) -> list[str]:
    """The section as Markdown (benchmarks/report.py)."""
    if not recovery:
        return []
    runs = recovery["runs"]

    def spread(key: str) -> str:
        values = [run[key] for run in runs]
        return f"{statistics.median(values):.1f} s ({min(values):.1f}-{max(values):.1f})"

    return [
        "",
        f"Recovery from a lost rank ({recovery['recipe']}, 2 processes, {recovery['engine']} "
        f"engine, a checkpoint every step; rank 1 SIGKILLed after step {KILL_AFTER_STEP}'s "
        f"checkpoint; median (range) of {len(runs)} runs):",
        "",
        "| kill -> next step | detection + restart | imports | start-up (build, checkpoint, "
        "engine, sync) | the lost step again |",
        "| --- | --- | --- | --- | --- |",
        f"| {spread('total_s')} | {spread('detect_restart_s')} | {spread('imports_s')} | "
        f"{spread('startup_s')} | {spread('lost_step_s')} |",
    ]
