"""Batch-wide sums and maxima when each data-parallel rank holds only its own groups.

The step keeps every tensor on the rank that holds its groups; the few statistics that span the
whole batch (REINFORCE++ whitening, GPG's alpha, the adaptive KL controller's mean KL, loss
denominators, logged metrics) are all-reduces of small tensors. Collectives on a training group
run on NCCL on GPUs, which reduces only tensors on the GPU, so every tensor goes to the model's
device first and comes back to where it was.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel.cpu_compat import device
from parallel.mesh import Mesh


class DataParallelStats:
    """Reductions over the data-parallel group of ``mesh`` (identities when ``dp == 1``)."""

    def __init__(self, mesh: Mesh) -> None:
        self.group = mesh.dp_group if mesh.dp > 1 else None

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Elementwise sum of ``tensor`` over the DP ranks (an ``algorithms.utils.BatchSum``)."""
        return self._all_reduce(tensor, dist.ReduceOp.SUM)

    def max(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._all_reduce(tensor, dist.ReduceOp.MAX)

    def _all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp) -> torch.Tensor:
        if self.group is None:
            return tensor
        on_device = tensor.detach().to(device(), copy=True)
        dist.all_reduce(on_device, op=op, group=self.group)
        return on_device.to(tensor.device)
