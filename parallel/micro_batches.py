"""Cutting a batch into micro-batches: the one place that does it (fixed rows, a token budget of
padded rows, or whole sequences to pack up to a token budget; each micro-batch trimmed to its own
longest row, or equal shapes for pipeline parallelism). ``parallel.schedule`` runs them through
megatron-core's schedules."""

from __future__ import annotations

from typing import TypeVar

import torch

from parallel.step_types import MicroBatch

Batch = TypeVar("Batch", bound=MicroBatch)


def micro_batches(
    batch: Batch,
    micro_batch_size: int,
    equal_sizes: bool = False,
    max_tokens: int = 0,
    pack: bool = False,
) -> list[Batch]:
    """Split a batch along its rows into micro-batches of the same type.

    Fixed size (``max_tokens == 0``): runs of ``micro_batch_size`` rows in order. Token budget
    (``max_tokens > 0``): rows sorted by length (``attention_mask``'s row sums, longest first)
    and packed greedily so that rows x the micro-batch's longest row stays within
    ``max_tokens`` (a single longer row gets a micro-batch of its own); similar lengths end up
    together, so little padding is computed. Row order changes: carry ``row_index`` (original
    row numbers) when outputs must be put back per row.

    Without ``equal_sizes`` every micro-batch is trimmed to its own longest sequence: its
    sequence fields (``parallel.step_types``) to the longest ``attention_mask`` row and, when the
    batch has a ``response_mask``, its response fields to the longest response. Right padding +
    causal attention make the trim exact. Response-aligned tensors must index positions below
    each row's own length (``response_index`` does).

    ``equal_sizes`` (pipeline parallelism: its stages exchange fixed-shape activations) keeps the
    batch-wide ``S`` and ``R`` and gives every micro-batch the same number of rows: the token
    budget becomes ``max(1, max_tokens // S)`` rows, and a short last micro-batch is filled with
    copies of its first row whose ``mask`` fields are zero, so every loss and metric ignores them
    (callers that read outputs per row cut them off at the batch size or use ``row_index``).

    ``pack`` (``parallel.schedule.forward_backward(pack_sequences=True)`` runs each micro-batch
    as one packed row of its real tokens): rows sorted longest first go to the first micro-batch
    whose real tokens stay within the budget (``max_tokens``, else ``micro_batch_size`` x ``S``,
    what a fixed micro-batch computes at most); a single longer row gets one of its own. Packed
    rows need no equal shapes under pipeline parallelism (the schedule pads each packed row to
    the call's longest), so ``equal_sizes`` is ignored and every micro-batch is trimmed.
    """
    rows, seq_len = batch.input_ids.shape[:2]
    lengths = batch.attention_mask.sum(dim=1).tolist()
    if pack:
        budget = max_tokens or micro_batch_size * seq_len
        return _cut(batch, _packing_groups(lengths, budget), trim=True)
    if max_tokens > 0 and equal_sizes:
        micro_batch_size = max(1, max_tokens // seq_len)
    if max_tokens > 0 and not equal_sizes:
        groups = _token_budget_groups(lengths, max_tokens)
    else:
        groups = [
            list(range(s, min(s + micro_batch_size, rows)))
            for s in range(0, rows, micro_batch_size)
        ]
    if not equal_sizes:
        return _cut(batch, groups, trim=True)
    parts = _cut(batch, groups, trim=False)
    missing = micro_batch_size - len(groups[-1])
    if missing > 0:
        parts[-1] = parts[-1].with_filler(missing)
    return parts


def _cut(batch: Batch, groups: list[list[int]], trim: bool) -> list[Batch]:
    parts = []
    for rows in groups:
        contiguous = rows == list(range(rows[0], rows[-1] + 1))
        part = batch.select(slice(rows[0], rows[-1] + 1) if contiguous else torch.tensor(rows))
        parts.append(_trim(part) if trim else part)
    return parts


def _token_budget_groups(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Row numbers per micro-batch: longest first, greedy within ``rows x longest <= budget``."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    for i in order:
        # Sorted longest first, so a group's first row is its longest.
        if groups and (len(groups[-1]) + 1) * max(1, lengths[groups[-1][0]]) <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _packing_groups(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Row numbers per micro-batch: first-fit decreasing, real tokens per micro-batch <= budget."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        fits = next((g for g, load in enumerate(loads) if load + lengths[i] <= max_tokens), None)
        if fits is None:
            groups.append([i])
            loads.append(lengths[i])
        else:
            groups[fits].append(i)
            loads[fits] += lengths[i]
    return groups


def _trim(part: Batch) -> Batch:
    """``part`` cut to its own longest sequence and longest response (see ``micro_batches``)."""
    seq_keep = max(1, int(part.attention_mask.sum(dim=1).max()))
    resp_keep = None
    if part.response_mask is not None:
        resp_keep = max(1, int((part.response_mask > 0).sum(dim=1).max()))
    return part.trimmed(seq_keep, resp_keep)
