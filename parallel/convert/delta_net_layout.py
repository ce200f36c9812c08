"""Gated DeltaNet's fused tensors between HF's layout and megatron-core's TP shards.

    delta_net_parts(kind, hf_names, hf_config) -> parts (each a list of HF row segments)
    parts_shard(read, parts, tp, tp_rank) -> this TP rank's shard
    parts_to_hf(full, parts, tp) -> [(hf_name, tensor)]

megatron's `GatedDeltaNet` computes q, k, v, the output gate z, beta and alpha with ONE
column-parallel in_proj and runs ONE depthwise conv1d over q, k, v; each TP rank holds the same
share of the heads of every part, so TP shard r is [q_r; k_r; v_r; z_r; beta_r; alpha_r]
(conv1d: [q_r; k_r; v_r]), and value head i reads key head i // (value heads / key heads).

HF keeps the parts in one of two layouts (rule kinds of `parallel.convert.registry`):
    linear_in_proj    Qwen3.5: in_proj_qkv ([q heads; k heads; v heads]), in_proj_z, in_proj_b,
                      in_proj_a, each head after head
    grouped_in_proj   Qwen3-Next: in_proj_qkvz and in_proj_ba grouped by key head: per key head
                      [q_g, k_g, its value heads' v, their z] and [their b, their a]
    linear_conv       both: conv1d over [q heads; k heads; v heads]
A part is listed as its heads' HF row segments (name, first row, rows) in megatron's order, so a
TP rank takes a contiguous run of every part's segments whatever the HF layout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Segment = tuple[str, int, int]  # HF name, first row, rows
Reader = Callable[[str, int | None, int, int], torch.Tensor]

DELTA_NET_KINDS = ("linear_in_proj", "grouped_in_proj", "linear_conv")


def delta_net_parts(kind: str, names: tuple[str, ...], hf_config: Any) -> list[list[Segment]]:
    """The parts of a Gated DeltaNet tensor in megatron's order, each its heads' HF segments."""
    nk, nv = hf_config.linear_num_key_heads, hf_config.linear_num_value_heads
    dk, dv = hf_config.linear_key_head_dim, hf_config.linear_value_head_dim
    per_key = nv // nk  # value heads per key head
    if kind == "grouped_in_proj":
        qkvz, ba = names
        group = 2 * dk + 2 * per_key * dv
        heads = [(g, j) for g in range(nk) for j in range(per_key)]  # value head g * per_key + j
        return [
            [(qkvz, g * group, dk) for g in range(nk)],
            [(qkvz, g * group + dk, dk) for g in range(nk)],
            [(qkvz, g * group + 2 * dk + j * dv, dv) for g, j in heads],
            [(qkvz, g * group + 2 * dk + (per_key + j) * dv, dv) for g, j in heads],
            [(ba, g * 2 * per_key + j, 1) for g, j in heads],
            [(ba, g * 2 * per_key + per_key + j, 1) for g, j in heads],
        ]
    qkv = names[0]
    parts = [
        [(qkv, h * dk, dk) for h in range(nk)],
        [(qkv, (nk + h) * dk, dk) for h in range(nk)],
        [(qkv, 2 * nk * dk + h * dv, dv) for h in range(nv)],
    ]
    if kind == "linear_conv":
        return parts
    z, beta, alpha = names[1:]
    return [
        *parts,
        [(z, h * dv, dv) for h in range(nv)],
        [(beta, h, 1) for h in range(nv)],
        [(alpha, h, 1) for h in range(nv)],
    ]


def _rank_segments(parts: list[list[Segment]], tp: int, tp_rank: int) -> list[Segment]:
    segments = []
    for part in parts:
        per_rank = len(part) // tp
        segments += part[tp_rank * per_rank : (tp_rank + 1) * per_rank]
    return segments


def parts_shard(read: Reader, parts: list[list[Segment]], tp: int, tp_rank: int) -> torch.Tensor:
    """This rank's shard, read in as few contiguous runs as the layout allows."""
    runs: list[list] = []
    for name, start, rows in _rank_segments(parts, tp, tp_rank):
        if runs and runs[-1][0] == name and runs[-1][1] + runs[-1][2] == start:
            runs[-1][2] += rows
        else:
            runs.append([name, start, rows])
    return torch.cat([read(name, 0, start, start + rows) for name, start, rows in runs])


def parts_to_hf(
    full: torch.Tensor, parts: list[list[Segment]], tp: int
) -> list[tuple[str, torch.Tensor]]:
    """The HF tensors of a TP-gathered tensor (its shards in rank order)."""
    sizes = {}
    for part in parts:
        for name, start, rows in part:
            sizes[name] = max(sizes.get(name, 0), start + rows)
    tensors = {name: full.new_empty((rows, *full.shape[1:])) for name, rows in sizes.items()}
    row = 0
    for tp_rank in range(tp):
        for name, start, rows in _rank_segments(parts, tp, tp_rank):
            tensors[name][start : start + rows] = full[row : row + rows]
            row += rows
    return list(tensors.items())
