"""Cutting a batch into micro-batches: the one place that does it (fixed rows or a token budget,
each micro-batch trimmed to its own longest row, or equal shapes for pipeline parallelism).
``parallel.schedule`` runs them through megatron-core's schedules."""

from __future__ import annotations

import torch

ROW_KEY = "row_index"
# The masks every loss and metric reads: zero on the filler rows of an equal-size micro-batch.
FILLER_ZEROED_MASKS = ("response_mask", "loss_mask")


def micro_batches(
    tensors: dict[str, torch.Tensor],
    micro_batch_size: int,
    equal_sizes: bool = False,
    max_tokens: int = 0,
) -> list[dict[str, torch.Tensor]]:
    """Split a batch of ``[B, ...]`` tensors along dim 0 into micro-batches.

    Fixed size (``max_tokens == 0``): runs of ``micro_batch_size`` rows in order. Token budget
    (``max_tokens > 0``): rows sorted by length (``attention_mask``'s row sums, longest first)
    and packed greedily so that rows x the micro-batch's longest row stays within
    ``max_tokens`` (a single longer row gets a micro-batch of its own); similar lengths end up
    together, so little padding is computed. Row order changes: carry ``ROW_KEY`` (original row
    numbers) when outputs must be put back per row.

    Without ``equal_sizes`` every micro-batch is trimmed to its own longest sequence: the
    ``[mb, S]`` tensors (``S`` = ``input_ids``' width) to the longest ``attention_mask`` row and,
    when the batch has a ``response_mask [B, R]``, the ``[mb, R]`` tensors to its longest row.
    Right padding + causal attention make the trim exact. Response-aligned tensors must index
    positions below each row's own length (``response_index`` does).

    ``equal_sizes`` (pipeline parallelism: its stages exchange fixed-shape activations) keeps the
    batch-wide ``S`` and ``R`` and gives every micro-batch the same number of rows: the token
    budget becomes ``max(1, max_tokens // S)`` rows, and a short last micro-batch is filled with
    copies of its first row; the copies get zero ``FILLER_ZEROED_MASKS`` (where the batch has
    them), so every loss and metric ignores them (callers that read outputs per row cut them off at the
    batch size or use ``ROW_KEY``).
    """
    batch = next(iter(tensors.values())).shape[0]
    if max_tokens > 0 and equal_sizes:
        micro_batch_size = max(1, max_tokens // tensors["input_ids"].shape[1])
    if max_tokens > 0 and not equal_sizes:
        groups = _token_budget_groups(tensors["attention_mask"].sum(dim=1).tolist(), max_tokens)
    else:
        groups = [
            list(range(s, min(s + micro_batch_size, batch)))
            for s in range(0, batch, micro_batch_size)
        ]
    parts = []
    for rows in groups:
        contiguous = rows == list(range(rows[0], rows[-1] + 1))
        index = slice(rows[0], rows[-1] + 1) if contiguous else torch.tensor(rows)
        parts.append({k: v[index] for k, v in tensors.items()})
    if equal_sizes:
        missing = micro_batch_size - len(groups[-1])
        if missing > 0:
            filler = {k: v[:1].expand(missing, *v.shape[1:]) for k, v in parts[-1].items()}
            for key in FILLER_ZEROED_MASKS:
                if key in filler:
                    filler[key] = torch.zeros_like(filler[key])
            parts[-1] = {k: torch.cat([v, filler[k]]) for k, v in parts[-1].items()}
        return parts
    return [_trim(part, tensors) for part in parts]


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


def _trim(part: dict[str, torch.Tensor], full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``part`` cut to its own longest sequence and longest response (see ``micro_batches``)."""
    seq_len = full["input_ids"].shape[1]
    seq_keep = max(1, int(part["attention_mask"].sum(dim=1).max()))
    widths = {seq_len: seq_keep}
    if "response_mask" in full and full["response_mask"].shape[1] != seq_len:
        resp_len = full["response_mask"].shape[1]
        widths[resp_len] = max(1, int((part["response_mask"] > 0).sum(dim=1).max()))
    return {
        k: v[:, : widths[v.shape[1]]] if v.dim() >= 2 and v.shape[1] in widths else v
        for k, v in part.items()
    }
