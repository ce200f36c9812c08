"""How the trainer's new weights reach the rollout engines: the weight-transport interface and its
factory (in the shape of NeMo-RL's weight synchronizer: one small interface, one factory that
chooses the transport).

    transport = make_transport(cfg.rollout, engine, adapters=actor.lora is not None)  # colocated
    transport = make_transport(cfg.rollout, weights_group=group)     # separate rollout ranks
    stats = transport.sync(actor.models, mesh)      # collective: every trainer rank calls it
    transport.close()                               # at the end of the run

The resharding itself (Megatron TP x PP shards -> full HF tensors in buckets) is
``parallel.reshard``; a transport only decides where the buckets go. Colocated engines load them
in place, in the same process (``InProcessTransport``). Engines on separate rollout ranks
(``rollout.placement=separate``) receive them over a process group spanning the trainer's
sending rank and the engines (``BroadcastTransport``; ``parallel.roles`` builds the group):
trainer rank 0 broadcasts each bucket as the resharding yields it, and every rollout rank loads
it as it arrives (``receive_weights``), so no side ever holds more than about one bucket beyond
its model.

A LoRA actor's weights travel one of two ways (``rollout.lora_sync``): ``merged``, the plain
transport, whose buckets then carry W + alpha/r * B A for every adapted tensor (computed per
bucket by ``parallel.reshard``; the trainer's base stays unmerged); or ``adapter``
(``InProcessAdapterTransport``, colocated engines only), where only the adapters move and the
engine applies them as a LoRA adapter.
"""

from __future__ import annotations

import shutil
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from parallel import cpu_compat
from parallel.roles import broadcast_object, broadcast_tensor
from rlcli.rollout.base import RolloutEngine

if TYPE_CHECKING:
    import torch.distributed as dist

    from parallel.mesh import Mesh
    from parallel.reshard import SyncStats
    from rlcli.config.schema import RolloutConfig


class WeightTransport(ABC):
    """Delivers the policy's weights to the rollout engines after each update."""

    @abstractmethod
    def sync(self, models: Sequence[torch.nn.Module], mesh: Mesh) -> SyncStats:
        """Collective: stream ``models``' weights (this rank's Megatron chunks) into the
        engines; what moved and how fast."""

    @abstractmethod
    def close(self) -> None:
        """Release what the transport holds between syncs (end of the run)."""


class InProcessTransport(WeightTransport):
    """Colocated engines: each rank's engine loads every bucket in place (``load_weights``)."""

    def __init__(self, engine: RolloutEngine, bucket_mb: float = 0) -> None:
        self.engine = engine
        self.bucket_mb = bucket_mb

    def sync(self, models: Sequence[torch.nn.Module], mesh: Mesh) -> SyncStats:
        from parallel.reshard import sync_weights

        return sync_weights(models, mesh, self.engine, self.bucket_mb)

    def close(self) -> None:
        pass  # nothing is held between syncs


class BroadcastTransport(WeightTransport):
    """Engines on separate rollout ranks (module docstring). ``group``: the weights group on
    trainer rank 0, None on the other trainer ranks (they reshard with it, send nothing).

    Per bucket, over ``group``: its layout ``[(hf_name, shape)]`` and dtype (one small object),
    then its tensors back to back in one flat buffer; ``None`` in place of a layout ends a sync.
    ``wait_seconds``: how long the last sync waited for the engines to take part (the first
    broadcast returns only then); its ``SyncStats.seconds`` leave that wait out.
    """

    def __init__(self, group: dist.ProcessGroup | None, bucket_mb: float = 0) -> None:
        self.group = group
        self.bucket_mb = bucket_mb
        self.wait_seconds = 0.0

    def sync(self, models: Sequence[torch.nn.Module], mesh: Mesh) -> SyncStats:
        from parallel.reshard import SyncStats, iter_inference_buckets

        start = time.perf_counter()
        num_bytes, num_buckets, wait = 0, 0, 0.0
        with cpu_compat.suspended():  # plain torch and collectives from here
            for bucket in iter_inference_buckets(models, mesh, self.bucket_mb):
                num_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
                num_buckets += 1
                if self.group is None:
                    continue
                (dtype,) = {t.dtype for _, t in bucket}  # a bucket never mixes dtypes
                layout = [(name, tuple(t.shape)) for name, t in bucket]
                announced = time.perf_counter()
                broadcast_object(self.group, (layout, dtype), device=cpu_compat.device())
                if num_buckets == 1:  # returns once every engine takes part: it waited for them
                    wait = time.perf_counter() - announced
                flat = torch.cat([t.reshape(-1) for _, t in bucket])
                broadcast_tensor(self.group, flat)
            if self.group is not None:
                broadcast_object(self.group, None, device=cpu_compat.device())
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.wait_seconds = wait
        seconds = max(time.perf_counter() - start - wait, 1e-9)
        return SyncStats(num_bytes, seconds, num_bytes / seconds / 1e9, num_buckets)

    def close(self) -> None:
        pass  # nothing is held between syncs; parallel.roles owns the group


def receive_weights(group: dist.ProcessGroup, engine: RolloutEngine) -> dict[str, float]:
    """A rollout rank's side of ``BroadcastTransport.sync``: load every bucket into ``engine``
    as it arrives (every rank of the weights group but the sender calls it). Returns
    ``engine/sync_s`` (receiving and loading) and ``engine/sync_gb``."""
    start = time.perf_counter()
    num_bytes = 0
    device = cpu_compat.device()
    while (item := broadcast_object(group, None, device=device)) is not None:
        layout, dtype = item
        sizes = [int(torch.Size(shape).numel()) for _, shape in layout]
        flat = torch.empty(sum(sizes), dtype=dtype, device=device)
        broadcast_tensor(group, flat)
        parts = flat.split(sizes)
        engine.load_weights(
            [(name, part.view(shape)) for (name, shape), part in zip(layout, parts, strict=True)]
        )
        num_bytes += flat.numel() * flat.element_size()
    return {"engine/sync_s": time.perf_counter() - start, "engine/sync_gb": num_bytes / 1e9}


class InProcessAdapterTransport(WeightTransport):
    """``rollout.lora_sync=adapter`` with colocated engines: each sync gathers only the LoRA
    adapters, writes them on every rank as a PEFT folder in memory (/dev/shm) and has the engine
    load it as its LoRA adapter (``engine.load_lora_adapter``); the engine keeps its base weights.
    When the engine holds no valid base (a dummy start, or weights discarded by a level-2 sleep)
    the sync first streams the base, unmerged."""

    def __init__(self, engine: RolloutEngine, bucket_mb: float = 0) -> None:
        from parallel.lora_io import default_adapter_folder

        if not engine.takes_lora_adapters:
            raise TypeError(f"{type(engine).__name__} was not started to take LoRA adapters")
        self.engine = engine
        self.bucket_mb = bucket_mb
        self.folder = default_adapter_folder()

    def sync(self, models: Sequence[torch.nn.Module], mesh: Mesh) -> SyncStats:
        from parallel.lora_io import sync_lora_adapter
        from parallel.reshard import SyncStats, sync_weights

        parts = []
        if self.engine.needs_weight_sync:  # every rank's engine is in the same state
            parts.append(sync_weights(models, mesh, self.engine, self.bucket_mb, merge_lora=False))
        parts.append(sync_lora_adapter(models, mesh, self.engine, self.folder))
        num_bytes, seconds = sum(p.bytes for p in parts), sum(p.seconds for p in parts)
        buckets = sum(p.num_buckets for p in parts)
        return SyncStats(num_bytes, seconds, num_bytes / max(seconds, 1e-9) / 1e9, buckets)

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def make_transport(
    rollout: RolloutConfig,
    engine: RolloutEngine | None = None,
    weights_group: dist.ProcessGroup | None = None,
    adapters: bool = False,
) -> WeightTransport:
    """The transport for the ``rollout`` section's placement: colocated engines load in process
    (``engine``: this rank's); separate ones receive broadcasts (``weights_group``: the group of
    ``parallel.roles`` on trainer rank 0, None on the other trainer ranks). ``adapters``: the
    policy has LoRA adapters, which ``rollout.lora_sync`` says how to send."""
    if rollout.is_separate:
        return BroadcastTransport(weights_group, rollout.sync_bucket_mb)
    if engine is None:
        raise ValueError("colocated engines load in process: make_transport needs the engine")
    if adapters and rollout.lora_sync == "adapter":
        return InProcessAdapterTransport(engine, rollout.sync_bucket_mb)
    return InProcessTransport(engine, rollout.sync_bucket_mb)
