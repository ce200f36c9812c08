"""The benchmark's grpo section: a short real run of the quickstart recipe through rlcli's trainer
(per-phase time shares from its metrics), then the plain PyTorch loop of plain_loop.py on the run's
own model, batch size and task, right after it."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from benchmarks.memory import measure_peak_memory
from benchmarks.workload import GRPO_BASE_OVERRIDES, Workload

REPO_ROOT = Path(__file__).resolve().parents[1]
QUICKSTART_RECIPE = REPO_ROOT / "recipes" / "quickstart.yaml"


# The trainer's phases in step order; each is timed on its own (none nests in another).
PHASE_ORDER = (
    "offload",
    "gen",
    "reward",
    "distribute",
    "onload",
    "old_log_prob",
    "ref",
    "adv",
    "update",
    "sync",
)


def grpo_section(workload: Workload, work_dir: Path) -> dict:
    from rlcli.run.metrics import METRICS_FILE_NAME, read_metrics_jsonl
    from rlcli.train.build import build_trainer
    from rlcli.validation.loader import load_config

    output_dir = work_dir / "grpo"
    overrides = [
        *GRPO_BASE_OVERRIDES,
        f"trainer.total_steps={workload.grpo_steps}",
        *workload.grpo_overrides,
    ]
    cfg = load_config(QUICKSTART_RECIPE, [*overrides, f"trainer.output_dir={output_dir}"])
    with measure_peak_memory() as memory:
        start = time.perf_counter()
        build_trainer(cfg).fit()
        wall_seconds = time.perf_counter() - start
    records = [r for r in read_metrics_jsonl(output_dir / METRICS_FILE_NAME) if "timing/step" in r]
    if not records:
        raise RuntimeError(f"the GRPO run logged no step timings in {output_dir}")
    measured = records[1:] if len(records) > 1 else records  # step 1 pays one-time warm-ups
    mean = {
        key.removeprefix("timing/"): sum(r.get(key, 0.0) for r in measured) / len(measured)
        for key in sorted({k for r in measured for k in r if k.startswith("timing/")})
    }
    step_seconds = mean.pop("step")
    mean.pop("val", None)  # validation is outside the step
    mean["other"] = max(0.0, step_seconds - sum(mean.values()))
    order = [*PHASE_ORDER, *sorted(set(mean) - set(PHASE_ORDER) - {"other"}), "other"]
    mean = {phase: mean[phase] for phase in order if phase in mean}
    return {
        "recipe": str(QUICKSTART_RECIPE.relative_to(REPO_ROOT)),
        "overrides": overrides,
        "steps": len(records),
        "measured_steps": len(measured),
        "step_seconds": step_seconds,
        "phases": {
            phase: {"seconds": seconds, "share": seconds / step_seconds}
            for phase, seconds in mean.items()
        },
        "tokens_per_s": sum(r.get("perf/tokens_per_s", 0.0) for r in measured) / len(measured),
        "wall_seconds": wall_seconds,
        "memory": memory.to_dict(),
        "median_step_seconds": statistics.median(r["timing/step"] for r in measured),
        "plain_loop": _plain_loop(cfg, output_dir, len(records)),
    }


def _plain_loop(cfg, output_dir: Path, steps: int) -> dict:
    """benchmarks/plain_loop.py on the run's own model, batch size and task, right after it."""
    from benchmarks.plain_loop import plain_grpo_step_seconds

    seconds = plain_grpo_step_seconds(
        str(output_dir / "model"),
        prompts=cfg.data.train_batch_size,
        n=cfg.rollout.n,
        max_tokens=cfg.rollout.max_tokens,
        lr=cfg.actor.lr,
        steps=max(1, steps - 1),
    )
    return {"step_seconds": seconds, "median_step_seconds": statistics.median(seconds)}
