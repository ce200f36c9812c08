"""How the trainer's new weights reach the rollout engines: the weight-transport interface and its
factory (in the shape of NeMo-RL's weight synchronizer: one small interface, one factory that
chooses the transport).

    transport = make_transport(cfg.rollout, engine)
    stats = transport.sync(actor.models, mesh)      # collective: every rank calls it

The resharding itself (Megatron TP x PP shards -> full HF tensors in buckets) is
``parallel.reshard``; a transport only decides where the buckets go. Colocated engines load them
in place, in the same process (``InProcessTransport``); engines on separate rollout ranks would
receive them over a process group spanning the trainer's sending ranks and the engines.
"""

from __future__ import annotations

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


class InProcessTransport(WeightTransport):
    """Colocated engines: each rank's engine loads every bucket in place (``load_weights``)."""

    def __init__(self, engine: RolloutEngine, bucket_mb: float = 0) -> None:
        self.engine = engine
        self.bucket_mb = bucket_mb

    def sync(self, models: Sequence[torch.nn.Module], mesh: Mesh) -> SyncStats:
        from parallel.reshard import sync_weights

        return sync_weights(models, mesh, self.engine, self.bucket_mb)


def make_transport(rollout: RolloutConfig, engine: RolloutEngine) -> WeightTransport:
    """The transport for the ``rollout`` section's placement (colocated engines: in process)."""
    return InProcessTransport(engine, rollout.sync_bucket_mb)
