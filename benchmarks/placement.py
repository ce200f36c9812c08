"""The benchmark's placement section: the same model, task and 2 processes, three ways, in one run:
colocated synchronous (both processes train and generate, DP 2), separate synchronous (1 trainer
rank, 1 rollout rank, ``trainer.max_staleness=0``) and separate with staleness 1 (generation of
step t + 1 overlapped with the training of step t, decoupled PPO).

Each is a real ``rlcli train --nproc 2`` of the quickstart recipe from one shared SFT warm start
(``rlcli sft``, run once), held-out accuracy measured before and after. Figures, from each run's
metrics.jsonl, over the steps after the first (which pays one-time warm-ups):

- steps/s: steps / the sum of their ``timing/step`` (the trainer's wall clock of a step);
- trainer idle share: the trainer's model waits. Colocated: while its rank generates and scores
  (``timing/gen + timing/reward``); separate: while it waits for samples or for the engine to
  take the weights (``timing/wait_rollout + sync/wait_s``);
- engine idle share: colocated, the time its rank does not generate (``1 - timing/gen / step``);
  separate, the rollout rank's wait for weights over its whole time (``engine/idle_s`` over
  ``engine/idle_s + engine/busy_s + engine/sync_s``);
- held-out accuracy per wall-clock second: (accuracy after - before) / the sum of every step's
  ``timing/step`` (start-up and evaluation excluded alike).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.formatting import pct
from benchmarks.workload import Workload

REPO_ROOT = Path(__file__).resolve().parents[1]
QUICKSTART_RECIPE = REPO_ROOT / "recipes" / "quickstart.yaml"
RUNS = {
    "colocated": [],
    "separate_sync": ["rollout.placement=separate", "rollout.num_ranks=1"],
    "separate_staleness_1": [
        "rollout.placement=separate",
        "rollout.num_ranks=1",
        "trainer.max_staleness=1",
        "algorithm.off_policy_correction=decoupled_ppo",
    ],
}
LABELS = {
    "colocated": "colocated, synchronous (DP 2)",
    "separate_sync": "separate 1 + 1, synchronous",
    "separate_staleness_1": "separate 1 + 1, staleness 1",
}
LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
COMMON = [
    "trainer.val_before_train=true",
    "checkpoint.save_freq=0",
    "checkpoint.save_optimizer=false",
    "logging.backends=[jsonl]",
]


def placement_section(workload: Workload, work_dir: Path) -> dict:
    work = work_dir / "placement"
    engine = workload.placement_engine or (
        "vllm" if importlib.util.find_spec("vllm") is not None else "hf"
    )
    common = [*COMMON, f"rollout.engine={engine}", *workload.placement_overrides]
    sft_dir = work / "sft"
    started = time.perf_counter()
    _rlcli(["sft", str(QUICKSTART_RECIPE), f"trainer.output_dir={sft_dir}",
            f"sft.steps={workload.placement_sft_steps}", *common], work, "sft")  # fmt: skip
    sft_seconds = time.perf_counter() - started
    start_from = [f"model.path={sft_dir / 'sft_model'}", "model.build=false", "sft.steps=0"]
    steps = workload.placement_steps
    length = [f"trainer.total_steps={steps}", f"trainer.val_freq={steps}"]
    runs = {}
    for name, overrides in RUNS.items():
        out = work / name
        args = ["train", "--nproc", "2", str(QUICKSTART_RECIPE), f"trainer.output_dir={out}"]
        wall = _rlcli([*args, *common, *start_from, *length, *overrides], work, name)
        runs[name] = {**run_figures(out / "metrics.jsonl"), "command_seconds": wall}
    sync, ahead, colocated = (
        runs["separate_sync"],
        runs["separate_staleness_1"],
        runs["colocated"],
    )
    return {
        "recipe": str(QUICKSTART_RECIPE.relative_to(REPO_ROOT)),
        "engine": engine,
        "overrides": common,
        "sft_steps": workload.placement_sft_steps,
        "sft_seconds": sft_seconds,
        "steps": steps,
        "runs": runs,
        "staleness_1_over_separate_sync": ahead["steps_per_s"] / sync["steps_per_s"],
        "staleness_1_over_colocated": ahead["steps_per_s"] / colocated["steps_per_s"],
        "accuracy_per_s_staleness_1_over_colocated": _ratio(
            ahead["accuracy_gain_per_s"], colocated["accuracy_gain_per_s"]
        ),
    }


def run_figures(metrics_file: Path) -> dict:
    """The module docstring's figures of one run."""
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "timing/step" in r]
    measured = steps[1:] or steps

    def total(key: str, among: list[dict] = measured) -> float:
        return sum(r.get(key, 0.0) for r in among)

    step_seconds = total("timing/step")
    separate = any("timing/wait_rollout" in r for r in steps)
    if separate:
        trainer_idle = (total("timing/wait_rollout") + total("sync/wait_s")) / step_seconds
        engine_time = total("engine/idle_s") + total("engine/busy_s") + total("engine/sync_s")
        engine_idle = total("engine/idle_s") / engine_time if engine_time else None
    else:
        trainer_idle = (total("timing/gen") + total("timing/reward")) / step_seconds
        engine_idle = 1 - total("timing/gen") / step_seconds
    evaluated = [r for r in rows if "val/reward/accuracy" in r]
    before, after = evaluated[0]["val/reward/accuracy"], evaluated[-1]["val/reward/accuracy"]
    train_seconds = total("timing/step", steps)
    return {
        "steps": len(steps),
        "steps_per_s": len(measured) / step_seconds,
        "trainer_idle_share": trainer_idle,
        "engine_idle_share": engine_idle,
        "accuracy_before": before,
        "accuracy_after": after,
        "train_seconds": train_seconds,
        "accuracy_gain_per_s": (after - before) / train_seconds,
        "staleness_max": max(r.get("rollout/staleness_max", 0.0) for r in steps),
    }


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def run_environment() -> dict[str, str]:
    """The environment of an ``rlcli`` run the benchmark starts: a launch of its own (not the
    torch.distributed world an earlier section of a smoke run left in this environment, whose
    store may still hold MASTER_PORT), two processes sharing the cores (one thread each)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    env["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // 2))
    return env


def _rlcli(args: list[str], work: Path, name: str) -> float:
    """Run ``rlcli ARGS`` (two processes share the cores: one thread each); its wall seconds.
    The log goes to ``<work>/<name>.log``; a failure raises with its tail."""
    work.mkdir(parents=True, exist_ok=True)
    env = run_environment()
    log = work / f"{name}.log"
    started = time.perf_counter()
    with open(log, "w") as handle:
        code = subprocess.call([sys.executable, "-m", "rlcli.cli", *args], cwd=REPO_ROOT,
                               env=env, stdout=handle, stderr=subprocess.STDOUT)  # fmt: skip
    if code != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"rlcli {' '.join(args[:2])} ({name}) exited {code}:\n{tail}")
    return time.perf_counter() - started


def placement_table(placement: dict | None) -> list[str]:
    """The section as Markdown (benchmarks/report.py)."""
    if not placement:
        return []

    lines = [
        "",
        f"Placement on 2 processes ({placement['recipe']}, {placement['engine']} engine, "
        f"{placement['steps']} GRPO steps from one {placement['sft_steps']}-step SFT warm "
        "start; figures over the steps after the first):",
        "",
        "| placement | steps/s | trainer idle | engine idle | held-out accuracy | "
        "accuracy gain per s |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, run in placement["runs"].items():
        lines.append(
            f"| {LABELS.get(name, name)} | {run['steps_per_s']:.2f} | "
            f"{pct(run['trainer_idle_share'])} | {pct(run['engine_idle_share'])} | "
            f"{pct(run['accuracy_before'])} -> {pct(run['accuracy_after'])} in "
            f"{run['train_seconds']:.0f} s | {100 * run['accuracy_gain_per_s']:.3f} pt/s |"
        )
    per_s = placement["accuracy_per_s_staleness_1_over_colocated"]
    lines += [
        "",
        f"Staleness 1: {placement['staleness_1_over_separate_sync']:.2f}x the steps/s of "
        f"separate synchronous, {placement['staleness_1_over_colocated']:.2f}x colocated's; "
        f"held-out accuracy gain per second {'n/a' if per_s is None else f'{per_s:.2f}x'} "
        "colocated's.",
    ]
    return lines
