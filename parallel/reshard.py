"""3D weight resharding: Megatron shards (TP x PP x DP) -> full HF tensors for the rollout engine.

Public API (stable):

    iter_inference_buckets(models, mesh, bucket_mb=0, merge_lora=True)
        -> Iterator[list[(hf_name, tensor)]]
        Collective: every rank of the job iterates it to the end and gets every bucket.
        bucket_mb <= 0: AUTO_BUCKET_MB, i.e. a small model travels as one bucket per stage.
        A model with LoRA adapters (parallel.lora) gives the MERGED weights W + (alpha/r) B A
        of every adapted HF module (computed per bucket; the trainer's base stays unmerged);
        merge_lora=False gives the base weights.
    iter_adapter_buckets(models, mesh, bucket_mb=0) -> Iterator[list[(peft_name, tensor)]]
        Only the LoRA adapters, full tensors under PEFT's names
        (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`); collective.
    sync_weights(models, mesh, engine, bucket_mb=0, merge_lora=True) -> SyncStats
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

A rank holds at most about two buckets beyond its own shards and its engine (the gather buffer
and the flat full buffer, released when the next bucket starts); never the whole model. Without
TP and PP nothing travels: the buckets are views of the parameters themselves (the engine copies).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from megatron.core.utils import unwrap_model

from parallel import cpu_compat
from parallel.convert.mapping import megatron_to_hf, param_mappings
from parallel.cpu_compat import device
from parallel.lora import adapter_params, lora_spec_of, peft_tensor_name
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
    local_shape: tuple[int, ...]  # the shard on one TP rank
    partition_dim: int | None  # None: replicated across TP
    dtype: torch.dtype
    module: str  # the unit of packing: a Megatron module and its LoRA adapters
    lora: tuple[str, str] | None = None  # a LoRA tensor: (HF module, "A" | "B")

    def full_shape(self, tp: int) -> tuple[int, ...]:
        shape = list(self.local_shape)
        if self.partition_dim is not None:
            shape[self.partition_dim] *= tp
        return tuple(shape)

    def full_numel(self, tp: int) -> int:
        return math.prod(self.full_shape(tp))


@dataclass(frozen=True)
class _Bucket:
    stage: int
    entries: tuple[_Entry, ...]
    dtype: torch.dtype


def _module_of(global_name: str) -> str:
    return global_name.rpartition(".")[0]


def _base_entries(
    chunks: list[torch.nn.Module], hf_config: Any, mesh: Mesh, lora: bool
) -> tuple[list[_Entry], dict[str, torch.Tensor]]:
    """The exported base parameters (with each adapted linear's adapters right after it when
    `lora`) as (entries, {global_name: local tensor})."""
    mappings = [
        m for m in param_mappings(chunks, hf_config, mesh.tp, mesh.tp_rank) if not m.skip_export
    ]
    adapters: dict[str, list[_Entry]] = {}
    tensors = {m.global_name: m.param for m in mappings}
    for entry, param in _adapter_entries(chunks) if lora else ():
        adapters.setdefault(entry.module, []).append(entry)
        tensors[entry.global_name] = param
    entries = []
    for index, m in enumerate(mappings):
        module = _module_of(m.global_name)
        entries.append(
            _Entry(m.global_name, tuple(m.param.shape), m.partition_dim, m.param.dtype, module)
        )
        if index + 1 == len(mappings) or _module_of(mappings[index + 1].global_name) != module:
            entries += adapters.pop(module, [])
    if adapters:
        raise RuntimeError(f"LoRA adapters of unknown linears: {sorted(adapters)}")
    return entries, tensors


def _adapter_entries(chunks: list[torch.nn.Module]) -> list[tuple[_Entry, torch.Tensor]]:
    return [
        (
            _Entry(
                a.global_name,
                tuple(a.param.shape),
                a.partition_dim,
                a.param.dtype,
                a.linear_name,
                (a.hf_module, a.matrix),
            ),
            a.param,
        )
        for a in adapter_params(chunks)
    ]


def _plan(mesh: Mesh, entries: list[_Entry], bucket_bytes: int) -> list[_Bucket]:
    """Buckets of every stage, identical on every rank (entries are exchanged over PP)."""
    per_stage = [entries]
    if mesh.pp > 1:
        per_stage = [None] * mesh.pp
        dist.all_gather_object(per_stage, entries, group=mesh.pp_group)
    buckets = []
    for stage, stage_entries in enumerate(per_stage):
        # Modules (consecutive entries of one module) are the unit of packing.
        modules: list[list[_Entry]] = []
        for entry in stage_entries:
            if modules and modules[-1][-1].module == entry.module:
                modules[-1].append(entry)
            else:
                modules.append([entry])
        current: list[_Entry] = []
        current_bytes = 0
        for module in modules:
            dtype = module[0].dtype
            size = sum(e.full_numel(mesh.tp) for e in module) * dtype.itemsize
            if current and (current_bytes + size > bucket_bytes or current[0].dtype != dtype):
                buckets.append(_Bucket(stage, tuple(current), current[0].dtype))
                current, current_bytes = [], 0
            current += module
            current_bytes += size
        if current:
            buckets.append(_Bucket(stage, tuple(current), current[0].dtype))
    return buckets


def _gather_full(bucket: _Bucket, by_name: dict[str, torch.Tensor], mesh: Mesh) -> torch.Tensor:
    """On the bucket's own stage: the bucket's full tensors, flattened back to back."""
    tp = mesh.tp
    sharded = [e for e in bucket.entries if e.partition_dim is not None and tp > 1]
    gathered = None
    if sharded:
        local = torch.cat([by_name[e.global_name].detach().reshape(-1) for e in sharded])
        gathered = torch.empty(tp * local.numel(), dtype=local.dtype, device=local.device)
        # One collective straight into one flat buffer (NCCL's native all-gather; a list of
        # outputs would cost NCCL an extra copy). gloo takes this flat form too.
        dist.all_gather_into_tensor(gathered, local, group=mesh.tp_group)
        gathered = gathered.view(tp, local.numel())
    total = sum(e.full_numel(tp) for e in bucket.entries)
    flat = torch.empty(total, dtype=bucket.dtype, device=device())
    offset, shard_offset = 0, 0
    for entry in bucket.entries:
        numel = entry.full_numel(tp)
        out = flat[offset : offset + numel].view(entry.full_shape(tp))
        if entry.partition_dim is not None and tp > 1:
            shard_numel = math.prod(entry.local_shape)
            shards = gathered[:, shard_offset : shard_offset + shard_numel]
            torch.cat([s.view(entry.local_shape) for s in shards], dim=entry.partition_dim, out=out)
            shard_offset += shard_numel
        else:
            out.copy_(by_name[entry.global_name].detach())
        offset += numel
    return flat


def _iter_full(
    mesh: Mesh, entries: list[_Entry], tensors: dict[str, torch.Tensor], bucket_mb: float
) -> Iterator[tuple[list[tuple[_Entry, torch.Tensor]], bool]]:
    """Per bucket: its (entry, full Megatron tensor) pairs, and whether the tensors are a fresh
    buffer (False: views of this rank's parameters, which must not be written)."""
    bucket_bytes = max(1, int((bucket_mb if bucket_mb > 0 else AUTO_BUCKET_MB) * 2**20))
    for bucket in _plan(mesh, entries, bucket_bytes):
        if mesh.pp == 1 and all(e.partition_dim is None or mesh.tp == 1 for e in bucket.entries):
            # Nothing to gather or send: the parameters themselves (views, no copy; every
            # engine copies what it loads), which saves one pass over the model's bytes.
            yield [(e, tensors[e.global_name].detach()) for e in bucket.entries], False
            continue
        if bucket.stage == mesh.pp_rank:
            flat = _gather_full(bucket, tensors, mesh)
        else:
            total = sum(e.full_numel(mesh.tp) for e in bucket.entries)
            flat = torch.empty(total, dtype=bucket.dtype, device=device())
        if mesh.pp > 1:
            source = dist.get_global_rank(mesh.pp_group, bucket.stage)
            dist.broadcast(flat, src=source, group=mesh.pp_group)
        pairs, offset = [], 0
        for entry in bucket.entries:
            numel = entry.full_numel(mesh.tp)
            pairs.append((entry, flat[offset : offset + numel].view(entry.full_shape(mesh.tp))))
            offset += numel
        yield pairs, True


def _merged(
    hf_tensors: list[tuple[str, torch.Tensor]],
    adapters: dict[tuple[str, str], torch.Tensor],
    scaling: float,
    owned: bool,
) -> list[tuple[str, torch.Tensor]]:
    """`hf_tensors` with W + scaling * B @ A for each HF module whose A and B are given: in
    place in a bucket's own buffer, else (views of the trainer's parameters) a new tensor."""
    merged = []
    for name, weight in hf_tensors:
        hf_module = name.removesuffix(".weight")
        if name.endswith(".weight") and (hf_module, "A") in adapters:
            a, b = adapters[(hf_module, "A")], adapters[(hf_module, "B")]
            if owned:
                weight = weight.addmm_(b, a, alpha=scaling)
            else:
                weight = torch.addmm(weight, b, a, alpha=scaling)
        merged.append((name, weight))
    return merged


@torch.no_grad()
def iter_inference_buckets(
    models: Sequence[torch.nn.Module], mesh: Mesh, bucket_mb: float = 0, merge_lora: bool = True
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Every rank gets every bucket of full HF tensors (module docstring); collective.

    Tensors are on `cpu_compat.device()` in the model's dtype; each bucket's tensors share one
    buffer, freed when the caller drops them (at TP1 x PP1: views of the parameters, except
    merged LoRA weights; copy them before the next optimizer step if they must be kept).
    """
    chunks = unwrap_model(list(models))  # megatron DDP / Float16Module wrappers
    hf_config: Any = chunks[0].hf_config
    spec = lora_spec_of(chunks) if merge_lora else None
    entries, tensors = _base_entries(chunks, hf_config, mesh, lora=spec is not None)
    for pairs, owned in _iter_full(mesh, entries, tensors, bucket_mb):
        hf_tensors, adapters = [], {}
        for entry, full in pairs:
            if entry.lora is not None:
                adapters[entry.lora] = full
            else:
                hf_tensors += megatron_to_hf(hf_config, mesh.tp, entry.global_name, full)
        yield _merged(hf_tensors, adapters, spec.scaling, owned) if adapters else hf_tensors


@torch.no_grad()
def iter_adapter_buckets(
    models: Sequence[torch.nn.Module], mesh: Mesh, bucket_mb: float = 0
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The LoRA adapters only, full tensors under PEFT's names; collective (module docstring).
    At TP1 x PP1 the tensors are views of the adapter parameters."""
    chunks = unwrap_model(list(models))  # megatron DDP / Float16Module wrappers
    if lora_spec_of(chunks) is None:
        raise ValueError("the model has no LoRA adapters (parallel.lora.apply_lora)")
    pairs = _adapter_entries(chunks)
    entries = [entry for entry, _ in pairs]
    tensors = {entry.global_name: param for entry, param in pairs}
    for bucket, _ in _iter_full(mesh, entries, tensors, bucket_mb):
        yield [(peft_tensor_name(*entry.lora), full) for entry, full in bucket]


def sync_weights(
    models: Sequence[torch.nn.Module],
    mesh: Mesh,
    engine: WeightConsumer,
    bucket_mb: float = 0,
    merge_lora: bool = True,
) -> SyncStats:
    """Stream the model into `engine.load_weights`, one bucket per call (collective); a LoRA
    model's adapters merged unless merge_lora=False (see iter_inference_buckets)."""
    start = time.perf_counter()
    num_bytes, num_buckets = 0, 0
    # Gathering is plain torch and collectives, loading is the engine's: nothing here calls
    # megatron-core, and under the CPU device mode vLLM's per-layer reload took a detour through
    # Python for every torch call (a third of a CPU sync).
    with cpu_compat.suspended():
        for bucket in iter_inference_buckets(models, mesh, bucket_mb, merge_lora):
            engine.load_weights(bucket)
            num_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
            num_buckets += 1
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return SyncStats(num_bytes, seconds, num_bytes / max(seconds, 1e-9) / 1e9, num_buckets)
