"""What crosses into ``parallel/`` and back: the typed boundary between a trainer and Megatron.

    MicroBatch    rows the model reads (and a loss reads): named tensors, each declaring its axis
    ModelOutputs  what the last pipeline stage hands a loss function for one micro-batch
    LossReport    what a loss function hands back besides its loss
    StepResult    what one optimizer step (``parallel.optim.train_step``) returns

``B`` / ``mb`` rows, ``S`` tokens per row (prompt + response, right-padded), ``R`` response
tokens per row. Every tensor field of a ``MicroBatch`` declares its axis with ``row_field``
(``[mb, ...]``, never trimmed), ``sequence_field`` (``[mb, S, ...]``, trimmed to the longest
``attention_mask`` row) or ``response_field`` (``[mb, R, ...]``, trimmed to the longest
``response_mask`` row); ``mask=True`` marks a mask every loss reads, zeroed on the filler rows
of an equal-size micro-batch. ``parallel.micro_batches`` cuts, trims and fills a batch by these
declarations alone, so a new per-token input (image features, routing decisions, teacher
log-probs) is one field on a subclass plus the code that reads it.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Self

import torch


class Axis(enum.Enum):
    """What dim 1 of a field runs over (dim 0 is always the rows)."""

    ROW = "row"  # [mb, ...]: one value (or one feature block) per row; never trimmed
    SEQUENCE = "sequence"  # [mb, S, ...]: one per token of the row
    RESPONSE = "response"  # [mb, R, ...]: one per response token of the row


_AXIS, _MASK = "axis", "mask"


def _declared(axis: Axis, mask: bool, default: Any) -> Any:
    metadata = {_AXIS: axis, _MASK: mask}
    if default is dataclasses.MISSING:
        return field(metadata=metadata)
    return field(default=default, metadata=metadata)


def row_field(*, default: Any = dataclasses.MISSING) -> Any:
    """A ``[mb, ...]`` field (one entry per row)."""
    return _declared(Axis.ROW, False, default)


def sequence_field(*, mask: bool = False, default: Any = dataclasses.MISSING) -> Any:
    """A ``[mb, S, ...]`` field (one entry per token); ``mask``: zero on filler rows."""
    return _declared(Axis.SEQUENCE, mask, default)


def response_field(*, mask: bool = False, default: Any = dataclasses.MISSING) -> Any:
    """A ``[mb, R, ...]`` field (one entry per response token); ``mask``: zero on filler rows."""
    return _declared(Axis.RESPONSE, mask, default)


@dataclass(kw_only=True)
class MicroBatch:
    """Right-padded rows (prompt then response), so plain causal attention is exact.

    Subclasses add the fields their loss reads (``rlcli.rollout.batch.RolloutBatch``, the reward
    model's pairs); every field is a tensor declared with ``row_field`` / ``sequence_field`` /
    ``response_field`` (module docstring), or None when not filled.
    """

    input_ids: torch.Tensor = sequence_field()  # [mb, S] int64
    attention_mask: torch.Tensor = sequence_field()  # [mb, S] int64, 1 on real tokens
    # [mb, S]; None: arange(S). A vision-language model's rows: [mb, S, 3], its multimodal
    # positions (temporal, height, width: parallel.vision_language.mrope_position_ids).
    position_ids: torch.Tensor | None = sequence_field(default=None)
    # [mb, R] float32, 1 on the response's positions: sets how far response fields are trimmed.
    response_mask: torch.Tensor | None = response_field(mask=True, default=None)
    # [mb, R] float32, 1 on the tokens that get a loss (generated ones; 0 on tool tokens).
    loss_mask: torch.Tensor | None = response_field(mask=True, default=None)
    row_index: torch.Tensor | None = row_field(default=None)  # [mb] int64, the batch's row numbers
    # [mb, S, L, k] int16: the experts each token went to in this rank's L MoE layers, recorded
    # by an earlier forward (-1: not recorded); a forward of rows that carry it replays it
    # (parallel.routing_replay).
    routing: torch.Tensor | None = sequence_field(default=None)
    # A vision-language model's images, row by row (parallel.vision_language): each row's
    # patches as its image processor made them, [mb, P, D] zero-padded to the batch's most, and
    # its images' (frames, rows, columns) of patches, [mb, I, 3], zero rows past its own.
    pixel_values: torch.Tensor | None = row_field(default=None)
    image_grid_thw: torch.Tensor | None = row_field(default=None)
    # [mb, S, k] int64: k token ids per position whose log-probs the forward also returns
    # (``ModelOutputs.scored_log_probs``; position t: candidates for token t+1), e.g. a
    # distillation teacher's likeliest tokens.
    scored_ids: torch.Tensor | None = sequence_field(default=None)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if _AXIS not in f.metadata:
                raise TypeError(
                    f"{type(self).__name__}.{f.name} declares no axis: declare it with "
                    "row_field(), sequence_field() or response_field() (parallel.step_types)"
                )

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    def filled(self) -> dict[str, torch.Tensor]:
        """The fields that hold a tensor, by name (field order)."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) is not None
        }

    def with_fields(
        self, change: Callable[[dataclasses.Field, torch.Tensor], torch.Tensor]
    ) -> Self:
        """A batch of the same type with ``change(field, tensor)`` applied to every filled field."""
        return dataclasses.replace(
            self,
            **{
                f.name: change(f, getattr(self, f.name))
                for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None
            },
        )

    def select(self, rows: torch.Tensor | slice) -> Self:
        """The rows ``rows`` (a slice, a bool mask or indices over the rows) of every field."""
        return self.with_fields(lambda f, value: value[rows])

    def to(self, target: torch.device | str) -> Self:
        return self.with_fields(lambda f, value: value.to(target))

    def trimmed(self, seq_keep: int, resp_keep: int | None) -> Self:
        """Sequence fields cut to ``seq_keep`` tokens, response fields to ``resp_keep`` (None:
        left whole), row fields unchanged."""
        widths = {Axis.ROW: None, Axis.SEQUENCE: seq_keep, Axis.RESPONSE: resp_keep}

        def cut(f: dataclasses.Field, value: torch.Tensor) -> torch.Tensor:
            width = widths[f.metadata[_AXIS]]
            return value if width is None else value[:, :width]

        return self.with_fields(cut)

    def with_filler(self, missing: int) -> Self:
        """``missing`` more rows, copies of row 0 whose ``mask`` fields are zero: rows that make
        up an equal-size micro-batch and that no loss or metric counts."""

        def fill(f: dataclasses.Field, value: torch.Tensor) -> torch.Tensor:
            filler = value[:1].expand(missing, *value.shape[1:])
            if f.metadata[_MASK]:
                filler = torch.zeros_like(filler)
            return torch.cat([value, filler])

        return self.with_fields(fill)


@dataclass
class ModelOutputs:
    """The last stage's outputs for one micro-batch, per row (float32): ``log_probs`` and, when
    asked, ``entropy`` ``[mb, S-1]`` (position t scores token t+1) of a policy model, or
    ``values [mb, S]`` of a value / score model. A policy model also gives, for a micro-batch
    with ``scored_ids``, their log-probs ``scored_log_probs [mb, S-1, k]``, and when asked for its
    likeliest ``k`` tokens (no-grad passes), ``top_log_probs`` and ``top_ids`` (int64)
    ``[mb, S-1, k]``, likeliest first. The others are None."""

    log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    values: torch.Tensor | None = None
    scored_log_probs: torch.Tensor | None = None
    top_log_probs: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None

    def filled(self) -> dict[str, torch.Tensor]:
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) is not None
        }


@dataclass
class LossReport:
    """What a loss function reports about one micro-batch besides its loss.

    ``metrics``: named values the caller logs (loss terms as partial sums, ratios as means; a
    0-dim tensor is taken as its float). ``sums`` / ``maxima``: float64 ``[k]`` partials of a
    batch-wide statistic the caller finishes itself, adding them up (taking the max) over
    micro-batches and data-parallel ranks, never logged as they are (the actor's log-prob
    agreement). All three are checked for finiteness before an optimizer step.
    """

    metrics: dict[str, float] = field(default_factory=dict)
    sums: torch.Tensor | None = None
    maxima: torch.Tensor | None = None

    def as_floats(self) -> LossReport:
        """The same report with the metrics as floats and the partials on the CPU (to be sent
        between pipeline stages)."""
        return LossReport(
            {name: float(value) for name, value in self.metrics.items()},
            None if self.sums is None else self.sums.detach().double().cpu(),
            None if self.maxima is None else self.maxima.detach().double().cpu(),
        )

    def is_finite(self) -> bool:
        partials = [t for t in (self.sums, self.maxima) if t is not None]
        return all(math.isfinite(value) for value in self.metrics.values()) and all(
            bool(torch.isfinite(t).all()) for t in partials
        )


# (outputs, micro-batch on the model's device) -> (scalar loss, report)
LossFn = Callable[[ModelOutputs, Any], tuple[torch.Tensor, LossReport]]


@dataclass
class MicroBatchResult:
    """``forward_backward``'s result for one micro-batch, on every model-parallel rank: the loss
    function's report (empty without a loss function) and, when ``forward_only``, the outputs
    (detached, float32, on ``device()``). This rank's own MoE layers add, when asked to record,
    ``routing [mb, S, L, k]`` (int16, on the CPU), and when replaying, ``routing_changed``
    (float64 ``[2]``: token-layers whose own top-k differed from the replayed one, token-layers;
    real tokens only) (``parallel.routing_replay``)."""

    report: LossReport
    outputs: ModelOutputs | None = None
    routing: torch.Tensor | None = None
    routing_changed: torch.Tensor | None = None


@dataclass
class StepResult:
    """One optimizer step (``parallel.optim.train_step``).

    ``reports``: each micro-batch's ``LossReport``, in order (the caller reduces them);
    ``grad_norm``: the global norm before clipping (None when the optimizer gives none, NaN on a
    non-finite step); ``lr``: the rate the step used; ``skipped``: the update was not applied
    (fp16 overflow, or a non-finite loss or gradient); ``nonfinite``: it was the latter (on
    every rank alike); ``routing_changed``: the micro-batches' ``routing_changed`` added up
    (this rank's MoE layers; None without replay).
    """

    reports: list[LossReport]
    grad_norm: float | None
    lr: float
    skipped: bool = False
    nonfinite: bool = False
    routing_changed: torch.Tensor | None = None
