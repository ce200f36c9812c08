"""Reduce a per-token loss matrix ``[batch, response_len]`` to a scalar, exactly under
gradient accumulation.

Every mode is written as ``numerator / denominator`` where the numerator is a SUM over the
sequences (rows) of the micro-batch, so when the caller passes the denominator of the whole
mini-batch (``global_denominator``), the micro-batch losses SUM to the mini-batch loss and their
gradients sum to its gradient; no rescaling by the number of micro-batches is needed.

"Non-empty sequence" below means a row with at least one mask token; all-padding rows add 0 to
the numerator and are not counted.

=========================  =========================================  =============================
mode                       numerator (sum over rows of the micro-      denominator
                           batch)                                      (``agg_loss_denominator``)
=========================  =========================================  =============================
token-mean                 sum of masked token losses                  number of mask tokens
seq-mean-token-sum         per-row token sum                           non-empty sequences
seq-mean-token-mean        per-row token mean                          non-empty sequences
seq-mean-token-sum-norm    per-row token sum                           non-empty sequences x
                                                                       ``norm_length`` (default:
                                                                       ``response_len``, the mask's
                                                                       last dimension)
=========================  =========================================  =============================

``seq-mean-token-sum-norm`` is Dr.GRPO's constant normaliser. Prefer a fixed ``norm_length``
(e.g. the configured max response length) so the scale does not change with padding. Note that
verl's version of this mode divides the SUM over sequences by the length (no mean over
sequences); ours is the sequence mean, i.e. verl's value divided by the number of sequences. To
reproduce verl's value pass ``global_denominator=norm_length``.

With data parallelism, give each rank the denominator of the GLOBAL mini-batch (all-reduce the
counts first) and sum, not average, the gradients; or give the per-rank denominator and average.
"""

from __future__ import annotations

import torch

LOSS_AGG_MODES = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def _check_mode(mode: str) -> None:
    if mode not in LOSS_AGG_MODES:
        raise ValueError(
            f"unknown loss aggregation mode {mode!r} (loss_agg_mode); "
            f"valid modes: {', '.join(LOSS_AGG_MODES)}"
        )


def agg_loss_denominator(
    mask: torch.Tensor, mode: str, norm_length: int | None = None
) -> torch.Tensor:
    """The denominator of ``mode`` for ``mask`` ``[batch, response_len]`` (a 0-dim float tensor).

    Compute it once from the FULL mini-batch mask and pass it as ``global_denominator`` to every
    micro-batch's ``agg_loss`` (or policy/value loss). ``norm_length`` only matters for
    ``seq-mean-token-sum-norm`` (default: ``mask.shape[-1]``). The result is clamped to at least
    1 so an all-padding batch gives a zero loss instead of NaN.
    """
    _check_mode(mode)
    mask = mask.float()
    if mode == "token-mean":
        denominator = mask.sum()
    else:
        denominator = (mask.sum(dim=-1) > 0).float().sum()
        if mode == "seq-mean-token-sum-norm":
            denominator = denominator * (norm_length if norm_length is not None else mask.shape[-1])
    return denominator.clamp(min=1.0)


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    global_denominator: float | torch.Tensor | None = None,
    norm_length: int | None = None,
) -> torch.Tensor:
    """Aggregate ``loss_mat`` ``[batch, response_len]`` under ``mask`` (same shape) to a 0-dim loss.

    ``global_denominator``: the mini-batch denominator from ``agg_loss_denominator`` (see the
    module docstring); None uses this batch's own, which makes ``agg_loss`` a plain mean.
    ``norm_length`` is only used by ``seq-mean-token-sum-norm`` when ``global_denominator`` is None.
    """
    _check_mode(mode)
    mask = mask.to(loss_mat.dtype)
    # Zero padding before multiplying so NaN/inf in padded positions cannot reach the sum.
    token_losses = torch.where(mask.bool(), loss_mat, torch.zeros_like(loss_mat)) * mask
    if mode == "seq-mean-token-mean":
        tokens_per_row = mask.sum(dim=-1)
        numerator = (token_losses.sum(dim=-1) / tokens_per_row.clamp(min=1.0)).sum()
    else:
        numerator = token_losses.sum()
    if global_denominator is None:
        global_denominator = agg_loss_denominator(mask, mode, norm_length)
    return numerator / global_denominator
