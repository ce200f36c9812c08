"""How the trainer's new weights reach the rollout engines: the weight-transport interface and its
factory (in the shape of NeMo-RL's weight synchronizer: one small interface, one factory that
chooses the transport).

    transport = make_transport(cfg.rollout, engine, adapters=actor.lora is not None)
    stats = transport.sync(actor.models, mesh)      # collective: every rank calls it
    transport.close()                               # at the end of the run

The resharding itself (Megatron TP x PP shards -> full HF tensors in buckets) is
``parallel.reshard``; a transport only decides where the buckets go. Colocated engines load them
in place, in the same process (``InProcessTransport``); engines on separate rollout ranks would
receive them over a process group spanning the trainer's sending ranks and the engines.

A LoRA actor's weights travel one of two ways (``rollout.lora_sync``): ``merged``, the plain
transport, whose buckets then carry W + alpha/r * B A for every adapted tensor (computed per
bucket by ``parallel.reshard``; the trainer's base stays unmerged); or ``adapter``
(``InProcessAdapterTransport``), where only the adapters move and the engine applies them as a
LoRA adapter.
"""

from __future__ import annotations

import shutil
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from rlcli.rollout.base import RolloutEngine

if TYPE_CHECKING:
    from parallel.mesh import Mesh
    from parallel.reshard import SyncStats
    from rlcli.config import RolloutConfig


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


class InProcessAdapterTransport(WeightTransport):
    """``rollout.lora_sync=adapter`` with colocated engines: each sync gathers only the LoRA
    adapters, writes them on every rank as a PEFT folder in memory (/dev/shm) and has the engine
    load it as its LoRA adapter (``engine.load_lora_adapter``); the engine keeps its base weights.
    When the engine holds no valid base (a dummy start, or weights discarded by a level-2 sleep)
    the sync first streams the base, unmerged."""

    def __init__(self, engine: RolloutEngine, bucket_mb: float = 0) -> None:
        from parallel.lora_io import default_adapter_folder

        if not hasattr(engine, "load_lora_adapter"):
            raise TypeError(f"{type(engine).__name__} cannot load LoRA adapters")
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
    rollout: RolloutConfig, engine: RolloutEngine, adapters: bool = False
) -> WeightTransport:
    """The transport for the ``rollout`` section's placement (colocated engines: in process);
    ``adapters``: the policy has LoRA adapters, which ``rollout.lora_sync`` says how to send."""
    if adapters and rollout.lora_sync == "adapter":
        return InProcessAdapterTransport(engine, rollout.sync_bucket_mb)
    return InProcessTransport(engine, rollout.sync_bucket_mb)
