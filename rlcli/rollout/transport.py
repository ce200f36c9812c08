"""How the trainer's new weights reach the rollout engines: the weight-transport interface and its
factory (in the shape of NeMo-RL's weight synchronizer: one small interface, one factory that
chooses the transport).

    transport = make_transport(cfg.rollout, engine)                  # colocated engines
    transport = make_transport(cfg.rollout, weights_group=group)     # separate rollout ranks
    stats = transport.sync(actor.models, mesh)      # collective: every trainer rank calls it

The resharding itself (Megatron TP x PP shards -> full HF tensors in buckets) is
``parallel.reshard``; a transport only decides where the buckets go. Colocated engines load them
in place, in the same process (``InProcessTransport``). Engines on separate rollout ranks
(``rollout.placement=separate``) receive them over a process group spanning the trainer's
sending rank and the engines (``BroadcastTransport``; ``parallel.roles`` builds the group):
trainer rank 0 broadcasts each bucket as the resharding yields it, and every rollout rank loads
it as it arrives (``receive_weights``), so no side ever holds more than about one bucket beyond
its model.
"""

from __future__ import annotations

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
    from rlcli.config import RolloutConfig


class WeightTransport(ABC):
    """Delivers the policy's weights to the rollout engines after each update."""

    @abstractmethod
    def sync(self, models: Sequence[torch.nn.Module], mesh: Mesh) -> SyncStats:
        """Collective: stream ``models``' weights (this rank's Megatron chunks) into the
        engines; what moved and how fast."""


class InProcessTransport(WeightTransport):
    """Colocated engines: each rank's engine loads every bucket in place (``load_weights``)."""

    def __init__(self, engine: RolloutEngine, bucket_mb: float = 0) -> None:
        self.engine = engine
        self.bucket_mb = bucket_mb

    def sync(self, models: Sequence[torch.nn.Module], mesh: Mesh) -> SyncStats:
        from parallel.reshard import sync_weights

        return sync_weights(models, mesh, self.engine, self.bucket_mb)


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


def make_transport(
    rollout: RolloutConfig,
    engine: RolloutEngine | None = None,
    weights_group: dist.ProcessGroup | None = None,
) -> WeightTransport:
    """The transport for the ``rollout`` section's placement: colocated engines load in process
    (``engine``: this rank's); separate ones receive broadcasts (``weights_group``: the group of
    ``parallel.roles`` on trainer rank 0, None on the other trainer ranks)."""
    if rollout.placement == "separate":
        return BroadcastTransport(weights_group, rollout.sync_bucket_mb)
    if engine is None:
        raise ValueError("colocated engines load in process: make_transport needs the engine")
    return InProcessTransport(engine, rollout.sync_bucket_mb)
