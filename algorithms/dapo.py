"""DAPO (Yu et al. 2025) extras: dynamic-sampling group filter and overlong reward shaping.

Shapes: ``metric_values``, ``group_index`` and ``response_lengths`` are ``[batch]``.
"""

from __future__ import annotations

import torch

from algorithms.utils import GroupIndex, group_ids_to_tensor


@torch.no_grad()
def filter_groups(
    metric_values: torch.Tensor, group_index: GroupIndex
) -> tuple[torch.Tensor, dict[str, int]]:
    """Keep only groups whose metric (e.g. the outcome reward or accuracy) varies.

    A group whose samples all have the same metric gives every sample a zero GRPO advantage, so it
    only dilutes the batch; DAPO drops it and samples more prompts. "Varies" is tested exactly
    (max > min), so float round-off in a std cannot keep a constant group. A group of ONE sample
    is dropped too (it has no spread; note verl keeps singleton groups).

    Returns ``(keep_mask [batch] bool, stats)`` with stats ``kept_groups``, ``total_groups``,
    ``kept_samples``, ``total_samples``.
    """
    metric_values = torch.as_tensor(metric_values)
    group_ids = group_ids_to_tensor(group_index, device=metric_values.device)
    num_groups = int(group_ids.max()) + 1 if group_ids.numel() else 0
    values = metric_values.to(torch.float64)
    group_max = torch.full((num_groups,), -torch.inf, dtype=values.dtype, device=values.device)
    group_min = torch.full((num_groups,), torch.inf, dtype=values.dtype, device=values.device)
    group_max.scatter_reduce_(0, group_ids, values, reduce="amax")
    group_min.scatter_reduce_(0, group_ids, values, reduce="amin")
    group_varies = group_max > group_min
    keep_mask = group_varies[group_ids]
    stats = {
        "kept_groups": int(group_varies.sum()),
        "total_groups": num_groups,
        "kept_samples": int(keep_mask.sum()),
        "total_samples": int(keep_mask.numel()),
    }
    return keep_mask, stats


def overlong_penalty(
    response_lengths: torch.Tensor,
    max_response_length: int,
    buffer_len: int,
    penalty_factor: float = 1.0,
) -> torch.Tensor:
    """DAPO soft overlong punishment ``[batch]`` (<= 0), added to the outcome reward.

    0 up to ``max_response_length - buffer_len`` tokens, then falls linearly to ``-penalty_factor``
    at ``max_response_length``: ``min(0, -(len - (max - buffer)) / buffer * penalty_factor)``
    (verl's DAPO reward manager; beyond the max it keeps falling linearly).
    """
    if not 0 < buffer_len <= max_response_length:
        raise ValueError(
            f"overlong buffer_len must be in (0, max_response_length={max_response_length}], "
            f"got {buffer_len}"
        )
    lengths = torch.as_tensor(response_lengths).to(torch.float32)
    exceed = lengths - (max_response_length - buffer_len)
    return torch.clamp(-exceed / buffer_len * penalty_factor, max=0.0)
