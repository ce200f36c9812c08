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

Mixture-of-experts models: vLLM keeps all experts of a layer in one fused tensor pair (FusedMoE's
w13 / w2) and rebuilds it from one call's tensors only, so a layer's routed experts (every
expert, gate, up and down) are one unit of packing, like a fused QKV. Each EP rank holds E/ep of
them; in step 1 the experts' shards are gathered over the expert-TP group, and the full experts
of every EP rank are then all-gathered in ONE collective over the expert-parallel group. The plan
lists every expert of the layer (in global order) on every rank, so all EP ranks agree on it.

A rank holds at most about two buckets beyond its own shards and its engine (the gather buffer
and the flat full buffer, released when the next bucket starts); never the whole model. Without
TP, PP and EP nothing travels: the buckets are views of the parameters themselves (the engine copies).
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
from parallel.convert.mapping import megatron_to_hf
from parallel.cpu_compat import device
from parallel.lora import lora_spec_of, peft_tensor_name
from parallel.mesh import Mesh
from parallel.reshard_plan import Bucket, Entry, adapter_entries, base_entries, plan_buckets

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


def _gather_into(
    entries: list[Entry],
    tensors: dict[str, torch.Tensor],
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
    local = torch.cat([tensors[e.global_name].detach().reshape(-1) for e in entries])
    gathered = torch.empty(size * local.numel(), dtype=local.dtype, device=local.device)
    dist.all_gather_into_tensor(gathered, local, group=group)
    gathered = gathered.view(size, local.numel())
    offset = 0
    for entry in entries:
        numel = math.prod(entry.local_shape)
        shards = [s.view(entry.local_shape) for s in gathered[:, offset : offset + numel]]
        torch.cat(shards, dim=entry.partition_dim, out=outputs[entry.global_name])
        offset += numel


def _flat_views(
    entries: list[Entry], dtype: torch.dtype
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One flat buffer for the full tensors of `entries`, back to back, and a full-shaped view
    of it per entry."""
    flat = torch.empty(sum(e.full_numel() for e in entries), dtype=dtype, device=device())
    views, offset = {}, 0
    for entry in entries:
        numel = entry.full_numel()
        views[entry.global_name] = flat[offset : offset + numel].view(entry.full_shape())
        offset += numel
    return flat, views


def _fill(
    entries: list[Entry],
    tensors: dict[str, torch.Tensor],
    views: dict[str, torch.Tensor],
    mesh: Mesh,
) -> None:
    """The full tensors of this rank's `entries` (TP- or expert-TP-split ones gathered)."""
    dense = [e for e in entries if e.owner is None]
    experts = [e for e in entries if e.owner is not None]
    _gather_into([e for e in dense if e.sharded], tensors, views, mesh.tp, mesh.tp_group)
    _gather_into([e for e in experts if e.sharded], tensors, views, mesh.etp, mesh.etp_group)
    for entry in entries:
        if not entry.sharded:
            views[entry.global_name].copy_(tensors[entry.global_name].detach())


def _gather_full(bucket: Bucket, tensors: dict[str, torch.Tensor], mesh: Mesh) -> torch.Tensor:
    """On the bucket's own stage: the bucket's full tensors, flattened back to back."""
    flat, views = _flat_views(list(bucket.entries), bucket.dtype)
    _fill([e for e in bucket.entries if e.owner is None], tensors, views, mesh)
    experts = [e for e in bucket.entries if e.owner is not None]
    if not experts:
        return flat
    # This rank's experts, full over expert TP, back to back; then every EP rank's, at once.
    own, own_views = _flat_views([e for e in experts if e.owner == mesh.ep_rank], bucket.dtype)
    _fill([e for e in experts if e.owner == mesh.ep_rank], tensors, own_views, mesh)
    every = own.view(1, -1)
    if mesh.ep > 1:
        every = torch.empty(mesh.ep * own.numel(), dtype=own.dtype, device=own.device)
        dist.all_gather_into_tensor(every, own, group=mesh.ep_group)
        every = every.view(mesh.ep, own.numel())
    offsets = [0] * mesh.ep  # each EP rank lists its experts in the same order
    for entry in experts:
        start, numel = offsets[entry.owner], entry.full_numel()
        views[entry.global_name].copy_(
            every[entry.owner, start : start + numel].view_as(views[entry.global_name])
        )
        offsets[entry.owner] += numel
    return flat


def _held_whole(entry: Entry, mesh: Mesh) -> bool:
    """This rank holds the full tensor itself (no TP split, no other EP rank's expert)."""
    return not entry.sharded and (entry.owner is None or mesh.ep == 1)


def _iter_full(
    mesh: Mesh, entries: list[Entry], tensors: dict[str, torch.Tensor], bucket_mb: float
) -> Iterator[tuple[list[tuple[Entry, torch.Tensor]], bool]]:
    """Per bucket: its (entry, full Megatron tensor) pairs, and whether the tensors are a fresh
    buffer (False: views of this rank's parameters, which must not be written)."""
    bucket_bytes = max(1, int((bucket_mb if bucket_mb > 0 else AUTO_BUCKET_MB) * 2**20))
    for bucket in plan_buckets(mesh, entries, bucket_bytes):
        if mesh.pp == 1 and all(_held_whole(e, mesh) for e in bucket.entries):
            # Nothing to gather or send: the parameters themselves (views, no copy; every
            # engine copies what it loads), which saves one pass over the model's bytes.
            yield [(e, tensors[e.global_name].detach()) for e in bucket.entries], False
            continue
        if bucket.stage == mesh.pp_rank:
            flat = _gather_full(bucket, tensors, mesh)
        else:
            total = sum(e.full_numel() for e in bucket.entries)
            flat = torch.empty(total, dtype=bucket.dtype, device=device())
        if mesh.pp > 1:
            source = dist.get_global_rank(mesh.pp_group, bucket.stage)
            dist.broadcast(flat, src=source, group=mesh.pp_group)
        pairs, offset = [], 0
        for entry in bucket.entries:
            numel = entry.full_numel()
            pairs.append((entry, flat[offset : offset + numel].view(entry.full_shape())))
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
    buffer, freed when the caller drops them (at TP1 x PP1 x EP1: views of the parameters, except
    merged LoRA weights; copy them before the next optimizer step if they must be kept).
    """
    chunks = unwrap_model(list(models))  # megatron DDP / Float16Module wrappers
    hf_config: Any = chunks[0].hf_config
    spec = lora_spec_of(chunks) if merge_lora else None
    entries, tensors = base_entries(chunks, hf_config, mesh, lora=spec is not None)
    for pairs, owned in _iter_full(mesh, entries, tensors, bucket_mb):
        hf_tensors, adapters = [], {}
        for entry, full in pairs:
            if entry.lora is not None:
                adapters[entry.lora] = full
            else:
                hf_tensors += megatron_to_hf(
                    hf_config, mesh.tp, entry.global_name, full, etp=mesh.etp
                )
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
    pairs = adapter_entries(chunks, mesh)
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
