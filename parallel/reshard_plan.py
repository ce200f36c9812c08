"""The plan of a weight sync (parallel.reshard): which exported Megatron parameters travel in
which bucket, the same on every rank.

    base_entries(chunks, hf_config, mesh, lora) -> (list[Entry], {global_name: local tensor})
    adapter_entries(chunks, mesh) -> list[(Entry, local adapter tensor)]
    plan_buckets(mesh, entries, bucket_bytes) -> list[Bucket]   (collective over PP)

A bucket never splits a unit of packing (Entry.module): a Megatron module with its LoRA
adapters, or all routed experts of a layer (listed for every EP rank, in global order).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from parallel.convert.hf_io import mesh_mappings
from parallel.convert.mapping import renumber_expert
from parallel.lora import adapter_params
from parallel.mesh import Mesh


@dataclass(frozen=True)
class Entry:
    """One exported Megatron parameter, as every rank of the pipeline sees it."""

    global_name: str
    local_shape: tuple[int, ...]  # the shard on one TP (routed experts: expert-TP) rank
    partition_dim: int | None  # None: replicated across TP
    dtype: torch.dtype
    module: str  # the unit of packing: a Megatron module and its LoRA adapters, or all routed
    # experts of a layer
    split: int  # the size of the TP group splitting it (tp, or etp for routed experts)
    owner: int | None = None  # routed experts: the EP rank holding it; None: every rank
    lora: tuple[str, str] | None = None  # a LoRA tensor: (HF module, "A" | "B")

    @property
    def sharded(self) -> bool:
        return self.partition_dim is not None and self.split > 1

    def full_shape(self) -> tuple[int, ...]:
        shape = list(self.local_shape)
        if self.partition_dim is not None:
            shape[self.partition_dim] *= self.split
        return tuple(shape)

    def full_numel(self) -> int:
        return math.prod(self.full_shape())


@dataclass(frozen=True)
class Bucket:
    stage: int
    entries: tuple[Entry, ...]
    dtype: torch.dtype


def _module_of(global_name: str, expert: bool) -> str:
    if expert:  # every routed expert of the layer: vLLM fuses them into one tensor pair
        return global_name.partition(".mlp.experts.")[0] + ".mlp.experts"
    return global_name.rpartition(".")[0]


def base_entries(
    chunks: list[torch.nn.Module], hf_config: Any, mesh: Mesh, lora: bool
) -> tuple[list[Entry], dict[str, torch.Tensor]]:
    """The exported base parameters (with each adapted linear's adapters right after it when
    `lora`) as (entries, {global_name: local tensor}); a layer's routed experts are listed
    for every EP rank (see _every_ep_rank), the tensors are this rank's own."""
    mappings = [m for m in mesh_mappings(chunks, hf_config, mesh) if not m.skip_export]
    adapters: dict[str, list[Entry]] = {}
    tensors = {m.global_name: m.param for m in mappings}
    for entry, param in adapter_entries(chunks, mesh) if lora else ():
        adapters.setdefault(entry.module, []).append(entry)
        tensors[entry.global_name] = param
    entries = []
    modules = [_module_of(m.global_name, m.expert) for m in mappings]
    for index, m in enumerate(mappings):
        entries.append(
            Entry(
                m.global_name,
                tuple(m.param.shape),
                m.partition_dim,
                m.param.dtype,
                modules[index],
                split=mesh.etp if m.expert else mesh.tp,
                owner=mesh.ep_rank if m.expert else None,
            )
        )
        if index + 1 == len(mappings) or modules[index + 1] != modules[index]:
            entries += adapters.pop(modules[index], [])
    if adapters:
        raise RuntimeError(f"LoRA adapters of unknown linears: {sorted(adapters)}")
    num_experts = getattr(hf_config, "num_experts", 0) or 0
    return _every_ep_rank(entries, mesh, num_experts // mesh.ep), tensors


def _every_ep_rank(entries: list[Entry], mesh: Mesh, local_experts: int) -> list[Entry]:
    """`entries` with each layer's routed experts (this rank's) replaced by those of every EP
    rank in global order, renamed to their global expert numbers: the same list on every EP
    rank."""
    listed: list[Entry] = []
    experts: list[Entry] = []  # this rank's routed experts of the current layer

    def flush() -> None:
        for owner in range(mesh.ep):
            shift = (owner - mesh.ep_rank) * local_experts
            listed.extend(
                replace(e, global_name=renumber_expert(e.global_name, shift), owner=owner)
                for e in experts
            )
        experts.clear()

    for entry in entries:
        if experts and (entry.owner is None or experts[-1].module != entry.module):
            flush()
        (experts if entry.owner is not None else listed).append(entry)
    flush()
    return listed


def adapter_entries(chunks: list[torch.nn.Module], mesh: Mesh) -> list[tuple[Entry, torch.Tensor]]:
    return [
        (
            Entry(
                a.global_name,
                tuple(a.param.shape),
                a.partition_dim,
                a.param.dtype,
                a.linear_name,
                split=mesh.tp,
                lora=(a.hf_module, a.matrix),
            ),
            a.param,
        )
        for a in adapter_params(chunks)
    ]


def plan_buckets(mesh: Mesh, entries: list[Entry], bucket_bytes: int) -> list[Bucket]:
    """Buckets of every stage, identical on every rank (entries are exchanged over PP)."""
    per_stage = [entries]
    if mesh.pp > 1:
        per_stage = [None] * mesh.pp
        dist.all_gather_object(per_stage, entries, group=mesh.pp_group)
    buckets = []
    for stage, stage_entries in enumerate(per_stage):
        # Modules (consecutive entries of one module) are the unit of packing.
        modules: list[list[Entry]] = []
        for entry in stage_entries:
            if modules and modules[-1][-1].module == entry.module:
                modules[-1].append(entry)
            else:
                modules.append([entry])
        current: list[Entry] = []
        current_bytes = 0
        for module in modules:
            dtype = module[0].dtype
            size = sum(e.full_numel() for e in module) * dtype.itemsize
            if current and (current_bytes + size > bucket_bytes or current[0].dtype != dtype):
                buckets.append(Bucket(stage, tuple(current), current[0].dtype))
                current, current_bytes = [], 0
            current += module
            current_bytes += size
        if current:
            buckets.append(Bucket(stage, tuple(current), current[0].dtype))
    return buckets
