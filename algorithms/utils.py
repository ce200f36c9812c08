"""Masked statistics and small tensor helpers shared by the RL math.

Shapes: ``values`` and ``mask`` are any matching shape, usually ``[batch, response_len]``;
``mask`` is 1 (or True) for response tokens and 0 for padding. Group ids are ``[batch]`` and may
be an int tensor, a numpy array (ints or strings, e.g. prompt uids) or a list.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

# A tensor, a list, or any array with ``tolist()`` (numpy), taken without importing numpy.
GroupIndex = torch.Tensor | Sequence | Any
# Sums a tensor over the whole batch when the batch is split across processes (the caller passes
# e.g. an all-reduce); the math here never sees a process group. None: this tensor IS the batch.
BatchSum = Callable[[torch.Tensor], torch.Tensor]


def masked_sum(
    values: torch.Tensor, mask: torch.Tensor, dim: int | tuple[int, ...] | None = None
) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is set; reduced over ``dim`` (all dims when None).

    Values under a zero mask are replaced by 0 first, so NaN/inf in padding cannot leak in.
    """
    selected = torch.where(mask.bool(), values, torch.zeros_like(values))
    return (selected * mask).sum(dim=dim)


def masked_mean(
    values: torch.Tensor, mask: torch.Tensor, dim: int | tuple[int, ...] | None = None
) -> torch.Tensor:
    """Mean of ``values`` over the masked elements (reduced over ``dim``, all dims when None).

    The 1e-8 in the denominator (as in verl) makes an all-padding row give 0 instead of NaN.
    """
    count = mask.sum(dim=dim)
    return masked_sum(values, mask, dim) / (count + 1e-8)


def masked_whiten(
    values: torch.Tensor,
    mask: torch.Tensor,
    shift_mean: bool = True,
    batch_sum: BatchSum | None = None,
) -> torch.Tensor:
    """``(values - mean) / sqrt(var + 1e-8)`` with mean and unbiased var over the masked elements.

    With ``shift_mean=False`` the mean is added back (only the scale is normalised).
    Output has the shape of ``values``; padding positions are not zeroed here. ``batch_sum``
    makes the statistics those of the whole batch when ``values`` is one share of it (the
    same arithmetic as on the concatenated batch).
    """
    total = batch_sum or _whole_batch
    count = total(mask.sum())
    mean = total(masked_sum(values, mask)) / (count + 1e-8)
    var = total(masked_sum((values - mean) ** 2, mask)) / (count + 1e-8)
    if count < 2:
        raise ValueError(
            f"masked_whiten needs at least 2 masked elements (unbiased variance), got {int(count)}; "
            "use a larger mini-batch"
        )
    var = var * count / (count - 1)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def _whole_batch(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def group_ids_to_tensor(
    group_index: GroupIndex, device: torch.device | None = None
) -> torch.Tensor:
    """Map arbitrary group ids ``[batch]`` to dense int64 ids ``0..num_groups-1`` (first-seen order).

    Accepts an int tensor, a numpy array (ints, strings or objects such as uuid strings) or a list.
    """
    if isinstance(group_index, torch.Tensor):
        _, dense = torch.unique(group_index, return_inverse=True)
        return dense.to(device=device if device is not None else group_index.device)
    dense_of: dict = {}
    ids = group_index.tolist() if hasattr(group_index, "tolist") else list(group_index)
    dense = [dense_of.setdefault(gid, len(dense_of)) for gid in ids]
    return torch.tensor(dense, dtype=torch.long, device=device)


def group_mean_std(
    scores: torch.Tensor, group_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample group statistics of ``scores`` ``[batch]`` grouped by dense ``group_ids`` ``[batch]``.

    Returns ``(mean, std, size)``, each ``[batch]`` (the statistic of the sample's own group).
    ``std`` is the unbiased (Bessel-corrected) standard deviation, like ``torch.std``; for a group
    of one it is NaN, and callers decide what a singleton means.
    """
    num_groups = int(group_ids.max()) + 1 if group_ids.numel() else 0
    size = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device)
    size.index_add_(0, group_ids, torch.ones_like(scores))
    total = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device)
    total.index_add_(0, group_ids, scores)
    mean = (total / size)[group_ids]
    # Two-pass variance (centre first) is as accurate as torch.std's algorithm.
    squared = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device)
    squared.index_add_(0, group_ids, (scores - mean) ** 2)
    group_size = size[group_ids]
    std = torch.sqrt(squared[group_ids] / (group_size - 1))
    return mean, std, group_size
