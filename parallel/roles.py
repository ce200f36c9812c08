"""One torchrun launch, two roles: trainer ranks and rollout ranks, each with its own default world.

Public API:

    init_role_world(num_rollout_ranks, timeout_s=1800) -> RoleWorld
    RoleWorld: role ("trainer" | "rollout"), rank / size (in the role's world), global_rank,
        global_size, num_trainer_ranks, store, weights (group), samples (group),
        barrier_all(name), role_environment()
    (the store's server lives in global rank 0's process: every rank passes a last
    ``barrier_all`` before that process may exit)
    broadcast_tensor(group, tensor, root=0), broadcast_object(group, obj, root=0, device=None)

Why separate worlds: megatron-core's ``initialize_model_parallel`` builds its groups over
torch.distributed's WHOLE default world, and vLLM's external launcher (``rollout.tp > 1``) takes
the default world as its own too. So the ranks of each role call ``init_process_group`` over
their own prefix of torchrun's store, with their own rank and size: megatron sees only the
trainer ranks, vLLM only the rollout ranks. The first ``global_size - num_rollout_ranks`` global
ranks train (global rank 0, which logs and writes checkpoints, is trainer rank 0); the last
``num_rollout_ranks`` roll out.

Between the roles, built directly over further prefixes of the same store (they are no part of
either default world, so torch.distributed's own collectives cannot name them; use the helpers
below or the groups' methods):

- ``weights``: trainer rank 0 (which broadcasts every resharded bucket: every trainer rank holds
  the full buckets after ``parallel.reshard.iter_inference_buckets``) and every rollout rank
  (each one loads full tensors; vLLM shards them itself). Rank 0 is trainer rank 0, rank 1 + i
  rollout rank i. NCCL on GPUs, gloo on CPU.
- ``samples``: trainer rank 0 and rollout rank 0 (gloo; samples are host data). Point-to-point:
  a gloo send returns at once and completes when the receiver posts its receive (measured), so
  the rollout ranks run ahead of the trainer without waiting for it.
- ``store``: the launch's key-value store under a per-attempt prefix (a torchrun restart never
  reads the dead attempt's keys): small messages that must never block their writer. Values are
  capped at 8 MiB by torch's libuv store server (measured: larger ones reset the connection).
"""

from __future__ import annotations

import os
import pickle
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore

Role = Literal["trainer", "rollout"]
BARRIER_POLL_S = 0.005


@dataclass
class RoleWorld:
    role: Role
    rank: int  # in the role's own default world (torch.distributed.get_rank())
    size: int
    global_rank: int  # in the torchrun launch
    global_size: int
    num_trainer_ranks: int
    store: dist.Store  # shared by every rank of the launch (this attempt's prefix)
    weights: dist.ProcessGroup | None  # trainer rank 0 + every rollout rank; None elsewhere
    samples: dist.ProcessGroup | None  # trainer rank 0 + rollout rank 0; None elsewhere
    timeout_s: float = 1800.0

    @property
    def is_trainer(self) -> bool:
        return self.role == "trainer"

    def barrier_all(self, name: str) -> None:
        """Wait until every rank of the launch, of both roles, reached the barrier ``name``
        (each name once per attempt); RuntimeError after ``timeout_s``."""
        key = f"barrier/{name}"
        if self.store.add(key, 1) == self.global_size:
            self.store.set(f"{key}/done", b"1")
        deadline = time.monotonic() + self.timeout_s
        while not self.store.check([f"{key}/done"]):
            if time.monotonic() > deadline:
                raise RuntimeError(f"not every rank reached {name!r} within {self.timeout_s:.0f} s")
            time.sleep(BARRIER_POLL_S)

    @contextmanager
    def role_environment(self) -> Iterator[None]:
        """``RANK`` and ``WORLD_SIZE`` as this role's world has them, inside the block: vLLM's
        external launcher reads them from the environment (``LOCAL_RANK``, the device index on
        the node, stays as torchrun set it)."""
        saved = {key: os.environ.get(key) for key in ("RANK", "WORLD_SIZE")}
        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.size))
        try:
            yield
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def attempt_prefix() -> str:
    """The store prefix of this torchrun attempt (restarts count up)."""
    return f"rlcli/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


def init_role_world(num_rollout_ranks: int, timeout_s: int = 1800) -> RoleWorld:
    """Start this rank's role world and the two cross-role groups (module docstring).

    Needs torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and
    ``0 < num_rollout_ranks < WORLD_SIZE``; call it instead of ``init_process_group`` (and before
    ``parallel.mesh.init_parallel``, which then uses the trainer's world).
    """
    from torch.distributed.rendezvous import rendezvous

    if dist.is_initialized():
        raise RuntimeError("init_role_world must run before torch.distributed is initialised")
    timeout = timedelta(seconds=timeout_s)
    launch_store, global_rank, global_size = next(rendezvous("env://", timeout=timeout))
    if not 0 < num_rollout_ranks < global_size:
        raise ValueError(
            f"{num_rollout_ranks} rollout ranks in a launch of {global_size}: both roles need ranks"
        )
    store = PrefixStore(attempt_prefix(), launch_store)
    trainers = global_size - num_rollout_ranks
    role: Role = "trainer" if global_rank < trainers else "rollout"
    rank = global_rank if role == "trainer" else global_rank - trainers
    size = trainers if role == "trainer" else num_rollout_ranks
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(
        backend="nccl" if on_gpu else "gloo",
        store=PrefixStore(f"{role}/", store),
        rank=rank,
        world_size=size,
        timeout=timeout,
    )
    weights = samples = None
    if role == "rollout" or rank == 0:
        weights_rank = 0 if role == "trainer" else 1 + rank
        weights = _group(
            PrefixStore("weights/", store), weights_rank, 1 + num_rollout_ranks, on_gpu, timeout
        )
    if rank == 0:
        samples_rank = 0 if role == "trainer" else 1
        samples = _group(PrefixStore("samples/", store), samples_rank, 2, False, timeout)
    return RoleWorld(
        role, rank, size, global_rank, global_size, trainers, store, weights, samples, timeout_s
    )


def _group(
    store: dist.Store, rank: int, size: int, nccl: bool, timeout: timedelta
) -> dist.ProcessGroup:
    if nccl:  # torch's CPU builds have no ProcessGroupNCCL: only reached with CUDA
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def broadcast_tensor(group: dist.ProcessGroup, tensor: torch.Tensor, root: int = 0) -> None:
    """In place, over a group built here (``root``: the group's rank)."""
    group.broadcast(tensor, root).wait()


def broadcast_object(
    group: dist.ProcessGroup,
    obj: Any,
    root: int = 0,
    device: torch.device | None = None,
) -> Any:
    """``root``'s picklable ``obj`` on every rank of ``group`` (two broadcasts: length, bytes).
    ``device``: where the bytes travel (NCCL needs the GPU). Only between ranks of one job."""
    device = device or torch.device("cpu")
    sender = group.rank() == root
    data = pickle.dumps(obj) if sender else b""
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    broadcast_tensor(group, length, root)
    if sender:
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    else:
        buffer = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    broadcast_tensor(group, buffer, root)
    return obj if sender else pickle.loads(buffer.cpu().numpy().tobytes())
