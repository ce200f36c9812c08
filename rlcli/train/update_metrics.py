"""One update's metrics from its optimizer steps' per-micro-batch metrics: what the actor and
the critic updates both report (loss terms summed over micro-batches, the rest averaged)."""

from __future__ import annotations

from parallel.step_types import StepResult


def reduce_step(result: StepResult, prefix: str, summed: tuple[str, ...] = ()) -> dict[str, float]:
    """One optimizer step's metrics: loss terms (``summed``) summed over micro-batches, the rest
    averaged; grad norm and lr under ``prefix``."""
    per_micro = [report.metrics for report in result.reports]
    out: dict[str, float] = {}
    for key in per_micro[0] if per_micro else []:
        values = [m[key] for m in per_micro if key in m]
        out[key] = sum(values) if key in summed else sum(values) / len(values)
    out[f"{prefix}/grad_norm"] = float(result.grad_norm or 0.0)
    out[f"{prefix}/lr"] = float(result.lr or 0.0)
    return out


def mean_over_steps(per_step: list[dict[str, float]]) -> dict[str, float]:
    """Each metric's mean over a update's optimizer steps."""
    if not per_step:
        return {}
    return {k: sum(step[k] for step in per_step) / len(per_step) for k in per_step[0]}
