"""3D weight resharding: Megatron shards (TP x PP x DP) -> full HF tensors for the rollout engine.

Public API (stable):

    iter_inference_buckets(models, mesh, bucket_mb=0) -> Iterator[list[(hf_name, tensor)]]
        Collective: every rank of the job iterates it to the end and gets every bucket.
        bucket_mb <= 0: AUTO_BUCKET_MB, i.e. a small model travels as one bucket per stage.
    sync_weights(models, mesh, engine, bucket_mb=0) -> SyncStats
        Streams the buckets into `engine.load_weights(list)` (any object with that method).
    SyncStats(bytes, seconds, gbps, num_buckets)

How a bucket travels. Every rank builds the same plan: the parameters of each pipeline stage, in
stage order, packed into buckets of at most `bucket_mb` MiB of full (TP-gathered) tensors. A
bucket never splits a Megatron module, so q, k, v and their biases (one `linear_qkv`) and gate
and up (one `linear_fc1`) always arrive in one `load_weights` call: vLLM rebuilds a fused layer
from one call's tensors only. For a bucket of stage s:

1. TP: the ranks of stage s put their shards of the bucket's TP-split parameters into one flat
   buffer and all-gather it in ONE collective over the TP group; the full tensors (shards
   concatenated along each parameter's partition dim, replicated ones as they are) are written
   into one flat buffer of the bucket.
2. PP: that flat buffer is broadcast in ONE collective from stage s to the other stages of the
   pipeline (each data-parallel replica does this in its own groups, in parallel).
3. Every rank cuts the buffer into HF tensors (fused QKV / gate-up split, vocab padding dropped)
   with `parallel.convert.megatron_to_hf`.

Mixture-of-experts models: vLLM keeps all experts of a layer in one fused tensor pair (FusedMoE's
w13 / w2) and rebuilds it from one call's tensors only, so a layer's routed experts (every
expert, gate, up and down) are one unit of packing, like a fused QKV. Each EP rank holds E/ep of
them; in step 1 the experts' shards are gathered over the expert-TP group, and the full experts
of every EP rank are then all-gathered in ONE collective over the expert-parallel group. The plan
lists every expert of the layer (in global order) on every rank, so all EP ranks agree on it.

A rank holds at most about two buckets beyond its own shards and its engine (the gather buffer
and the flat full buffer, released when the next bucket starts); never the whole model. Without
TP and PP nothing travels: the buckets are views of the parameters themselves (the engine copies).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch
import torch.distributed as dist

from parallel import cpu_compat
from parallel.convert.hf_io import mesh_mappings
from parallel.convert.mapping import ParamMapping, megatron_to_hf, renumber_expert
from parallel.cpu_compat import device
from parallel.mesh import Mesh

# The default bucket cap. Every bucket costs the engine one load call (vLLM: an RPC, a prefix
# cache reset), so fewer buckets are faster; a rank holds about two buckets beyond its shards, so
# the cap bounds that memory for large models (a 7B model in bf16 is about 28 buckets).
AUTO_BUCKET_MB = 512


class WeightConsumer(Protocol):
    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None: ...


@dataclass(frozen=True)
class SyncStats:
    bytes: int  # bytes of HF tensors handed to the engine on this rank
    seconds: float
    gbps: float  # bytes / seconds / 1e9
    num_buckets: int


@dataclass(frozen=True)
class _Entry:
    """One exported Megatron parameter, as every rank of the pipeline sees it."""

    global_name: str
    local_shape: tuple[int, ...]  # the shard on one TP (routed experts: expert-TP) rank
    partition_dim: int | None  # None: replicated across TP
    dtype: torch.dtype
    split: int  # the size of the TP group splitting it (tp, or etp for routed experts)
    owner: int | None = None  # routed experts: the EP rank holding it; None: every rank

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
class _Bucket:
    stage: int
    entries: tuple[_Entry, ...]
    dtype: torch.dtype


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    while hasattr(chunk, "module"):  # megatron DDP / Float16Module wrappers
        chunk = chunk.module
    return chunk


def _module_of(entry: _Entry) -> str:
    """The unit of packing: the Megatron module, or all routed experts of a layer."""
    if entry.owner is not None:
        return entry.global_name.partition(".mlp.experts.")[0]
    return entry.global_name.rpartition(".")[0]


def _entries(mappings: list[ParamMapping], mesh: Mesh, num_experts: int) -> list[_Entry]:
    """This stage's entries; a layer's routed experts listed for every EP rank, in global
    order (the same list on every EP rank)."""
    entries: list[_Entry] = []
    experts: list[_Entry] = []  # this rank's routed experts of the current layer
    local_experts = num_experts // mesh.ep if num_experts else 0

    def flush() -> None:
        for owner in range(mesh.ep):
            shift = (owner - mesh.ep_rank) * local_experts
            entries.extend(
                replace(e, global_name=renumber_expert(e.global_name, shift), owner=owner)
                for e in experts
            )
        experts.clear()

    for m in mappings:
        entry = _Entry(
            m.global_name,
            tuple(m.param.shape),
            m.partition_dim,
            m.param.dtype,
            split=mesh.etp if m.expert else mesh.tp,
            owner=mesh.ep_rank if m.expert else None,
        )
        if experts and (entry.owner is None or _module_of(experts[-1]) != _module_of(entry)):
            flush()
        (experts if m.expert else entries).append(entry)
    flush()
    return entries


def _plan(mesh: Mesh, entries: list[_Entry], bucket_bytes: int) -> list[_Bucket]:
    """Buckets of every stage, identical on every rank (entries are exchanged over PP)."""
    per_stage = [entries]
    if mesh.pp > 1:
        per_stage = [None] * mesh.pp
        dist.all_gather_object(per_stage, entries, group=mesh.pp_group)
    buckets = []
    for stage, stage_entries in enumerate(per_stage):
        # Modules (consecutive entries of one unit, see _module_of) are the unit of packing.
        modules: list[list[_Entry]] = []
        for entry in stage_entries:
            if modules and _module_of(modules[-1][-1]) == _module_of(entry):
                modules[-1].append(entry)
            else:
                modules.append([entry])
        current: list[_Entry] = []
        current_bytes = 0
        for module in modules:
            dtype = module[0].dtype
            size = sum(e.full_numel() for e in module) * dtype.itemsize
            if current and (current_bytes + size > bucket_bytes or current[0].dtype != dtype):
                buckets.append(_Bucket(stage, tuple(current), current[0].dtype))
                current, current_bytes = [], 0
            current += module
            current_bytes += size
        if current:
            buckets.append(_Bucket(stage, tuple(current), current[0].dtype))
    return buckets


def _gather_into(
    entries: list[_Entry],
    by_name: dict[str, ParamMapping],
    outputs: dict[str, torch.Tensor],
    size: int,
    group: Any,
) -> None:
    """Write the full tensors of TP-split `entries` into `outputs` (name -> full-shaped view):
    their shards on the `size` ranks of `group`, gathered in ONE collective (NCCL's native
    all-gather into one flat buffer; a list of outputs would cost NCCL an extra copy; gloo
    takes this flat form too)."""
    if not entries:
        return
    local = torch.cat([by_name[e.global_name].param.detach().reshape(-1) for e in entries])
    gathered = torch.empty(size * local.numel(), dtype=local.dtype, device=local.device)
    dist.all_gather_into_tensor(gathered, local, group=group)
    gathered = gathered.view(size, local.numel())
    offset = 0
    for entry in entries:
        numel = math.prod(entry.local_shape)
        shards = [s.view(entry.local_shape) for s in gathered[:, offset : offset + numel]]
        torch.cat(shards, dim=entry.partition_dim, out=outputs[entry.global_name])
        offset += numel


def _gather_full(bucket: _Bucket, by_name: dict[str, ParamMapping], mesh: Mesh) -> torch.Tensor:
    """On the bucket's own stage: the bucket's full tensors, flattened back to back."""
    flat = torch.empty(
        sum(e.full_numel() for e in bucket.entries), dtype=bucket.dtype, device=device()
    )
    views, offset = {}, 0
    for entry in bucket.entries:
        views[entry.global_name] = flat[offset : offset + entry.full_numel()].view(
            entry.full_shape()
        )
        offset += entry.full_numel()
    dense = [e for e in bucket.entries if e.owner is None]
    _gather_into([e for e in dense if e.sharded], by_name, views, mesh.tp, mesh.tp_group)
    for entry in dense:
        if not entry.sharded:
            views[entry.global_name].copy_(by_name[entry.global_name].param.detach())
    experts = [e for e in bucket.entries if e.owner is not None]
    if not experts:
        return flat
    # This rank's experts, full over expert TP, back to back; then every EP rank's, at once.
    mine = [e for e in experts if e.owner == mesh.ep_rank]
    own = torch.empty(sum(e.full_numel() for e in mine), dtype=bucket.dtype, device=device())
    own_views, offset = {}, 0
    for entry in mine:
        own_views[entry.global_name] = own[offset : offset + entry.full_numel()].view(
            entry.full_shape()
        )
        offset += entry.full_numel()
    _gather_into([e for e in mine if e.sharded], by_name, own_views, mesh.etp, mesh.etp_group)
    for entry in mine:
        if not entry.sharded:
            own_views[entry.global_name].copy_(by_name[entry.global_name].param.detach())
    every = own.view(1, -1)
    if mesh.ep > 1:
        every = torch.empty(mesh.ep * own.numel(), dtype=own.dtype, device=own.device)
        dist.all_gather_into_tensor(every, own, group=mesh.ep_group)
        every = every.view(mesh.ep, own.numel())
    offsets = [0] * mesh.ep  # each EP rank lists its experts in the same order
    for entry in experts:
        numel = entry.full_numel()
        start = offsets[entry.owner]
        views[entry.global_name].copy_(
            every[entry.owner, start : start + numel].view_as(views[entry.global_name])
        )
        offsets[entry.owner] += numel
    return flat


def _held_whole(entry: _Entry, mesh: Mesh) -> bool:
    """This rank holds the full tensor itself (no TP split, no other EP rank's expert)."""
    return not entry.sharded and (entry.owner is None or mesh.ep == 1)


@torch.no_grad()
def iter_inference_buckets(
    models: Sequence[torch.nn.Module], mesh: Mesh, bucket_mb: float = 0
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Every rank gets every bucket of full HF tensors (module docstring); collective.

    Tensors are on `cpu_compat.device()` in the model's dtype; each bucket's tensors share one
    buffer, freed when the caller drops them (at TP1 x PP1 x EP1: views of the parameters; copy
    them before the next optimizer step if they must be kept).
    """
    chunks = [_unwrap(chunk) for chunk in models]
    hf_config: Any = chunks[0].hf_config
    mappings = [m for m in mesh_mappings(chunks, hf_config, mesh) if not m.skip_export]
    by_name = {m.global_name: m for m in mappings}
    entries = _entries(mappings, mesh, getattr(hf_config, "num_experts", 0) or 0)
    bucket_bytes = max(1, int((bucket_mb if bucket_mb > 0 else AUTO_BUCKET_MB) * 2**20))
    for bucket in _plan(mesh, entries, bucket_bytes):
        if mesh.pp == 1 and all(_held_whole(e, mesh) for e in bucket.entries):
            # Nothing to gather or send: the parameters themselves (views, no copy; every
            # engine copies what it loads), which saves one pass over the model's bytes.
            yield [
                item
                for e in bucket.entries
                for item in megatron_to_hf(
                    hf_config,
                    mesh.tp,
                    e.global_name,
                    by_name[e.global_name].param.detach(),
                    etp=mesh.etp,
                )
            ]
            continue
        if bucket.stage == mesh.pp_rank:
            flat = _gather_full(bucket, by_name, mesh)
        else:
            total = sum(e.full_numel() for e in bucket.entries)
            flat = torch.empty(total, dtype=bucket.dtype, device=device())
        if mesh.pp > 1:
            source = dist.get_global_rank(mesh.pp_group, bucket.stage)
            dist.broadcast(flat, src=source, group=mesh.pp_group)
        hf_tensors = []
        offset = 0
        for entry in bucket.entries:
            numel = entry.full_numel()
            full = flat[offset : offset + numel].view(entry.full_shape())
            hf_tensors += megatron_to_hf(hf_config, mesh.tp, entry.global_name, full, etp=mesh.etp)
            offset += numel
        yield hf_tensors


def sync_weights(
    models: Sequence[torch.nn.Module], mesh: Mesh, engine: WeightConsumer, bucket_mb: float = 0
) -> SyncStats:
    """Stream the model into `engine.load_weights`, one bucket per call (collective)."""
    start = time.perf_counter()
    num_bytes, num_buckets = 0, 0
    # Gathering is plain torch and collectives, loading is the engine's: nothing here calls
    # megatron-core, and under the CPU device mode vLLM's per-layer reload took a detour through
    # Python for every torch call (a third of a CPU sync).
    with cpu_compat.suspended():
        for bucket in iter_inference_buckets(models, mesh, bucket_mb):
            engine.load_weights(bucket)
            num_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
            num_buckets += 1
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return SyncStats(num_bytes, seconds, num_bytes / max(seconds, 1e-9) / 1e9, num_buckets)
