"""parallel.step_types: the typed boundary's own behaviour (what micro_batches relies on, and
the loss report a train step checks before it steps)."""

from __future__ import annotations

import math

import pytest
import torch

from parallel.step_types import LossReport, MicroBatch


def test_select_and_to_keep_the_type_and_every_filled_field():
    batch = MicroBatch(
        input_ids=torch.arange(6).view(3, 2),
        attention_mask=torch.ones(3, 2, dtype=torch.long),
        row_index=torch.arange(3),
    )
    picked = batch.select(torch.tensor([2, 0])).to("cpu")
    assert type(picked) is MicroBatch and picked.size == 2
    assert picked.row_index.tolist() == [2, 0] and picked.input_ids.tolist() == [[4, 5], [0, 1]]
    assert picked.position_ids is None and picked.loss_mask is None  # unfilled stays unfilled
    assert list(picked.filled()) == ["input_ids", "attention_mask", "row_index"]


@pytest.mark.parametrize(
    ("report", "finite"),
    [
        (LossReport({"loss": 1.0}), True),
        (LossReport({"loss": math.nan}), False),
        (LossReport({"loss": 1.0}, sums=torch.tensor([1.0, math.inf], dtype=torch.float64)), False),
        (LossReport({}, maxima=torch.tensor([math.nan], dtype=torch.float64)), False),
    ],
)
def test_a_non_finite_metric_or_partial_sum_makes_the_report_non_finite(report, finite):
    # The actor's log-prob agreement sums are checked as its metrics are: a step that produced
    # a non-finite one is dropped (parallel.optim.train_step).
    assert report.as_floats().is_finite() is finite


def test_as_floats_turns_tensor_metrics_into_floats_and_partials_to_cpu_float64():
    report = LossReport({"pairs": torch.tensor(3.0)}, sums=torch.tensor([1.0, 2.0])).as_floats()
    assert report.metrics == {"pairs": 3.0} and isinstance(report.metrics["pairs"], float)
    assert report.sums.dtype == torch.float64 and report.maxima is None
