"""Process groups: torch.distributed + megatron-core tensor / pipeline / data / expert parallel
state.

Public API (stable):

    init_parallel(tp=1, pp=1, vpp=None, seed=1234, timeout_s=1800, ep=1, etp=None) -> Mesh
    destroy_parallel() -> None
    ParallelLayoutError(ValueError)
    Mesh: frozen dataclass
        world_size, rank, local_rank, tp, pp, dp, vpp, tp_rank, pp_rank, dp_rank,
        is_first_stage, is_last_stage                     (ints / bools, ignoring virtual stages)
        ep, etp, ep_rank, etp_rank                        (expert parallel, expert tensor parallel)
        tp_group, pp_group, dp_group (torch ProcessGroups, properties)
        ep_group, etp_group          (the expert groups, properties)
        last_stage_global_rank() (the global rank of this rank's pipeline's last stage)
        broadcast_from_last_stage(tensor)                  (in place, over the pp group)
        broadcast_object_from_last_stage(obj) -> obj       (picklable objects, over the pp group)

`init_parallel` reads the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT); without it, it runs as a single process (world size 1). It uses nccl when CUDA is
available and gloo otherwise, in which case it first enables `parallel.cpu_compat`. Data-parallel
size is derived: dp = world_size // (tp * pp). The group order is megatron's default
("tp-cp-ep-dp-pp"): TP ranks are adjacent global ranks.

Expert parallelism (MoE models; megatron's expert_model_parallel_size / expert_tensor_parallel_
size): the routed experts' weights are laid out over their own groups, etp x ep x edp x pp =
world_size, with the same pipeline stages; etp defaults to tp. Each expert lives on one EP rank
(split over its expert-TP group); the attention and every other weight keep the TP x DP layout.
With etp = tp, ep must divide dp; with etp = 1 (the usual choice with TP), ep must divide tp*dp.

Seeding: megatron's `model_parallel_cuda_manual_seed(seed)` sets up its RNG tracker (per-TP-rank
streams for tensor-parallel weight init), and torch's default CPU generator is seeded with `seed`
on every rank, so data-parallel replicas build identical weights (on CPU, weight init draws from
the CPU generator, which megatron itself never seeds).
"""

from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

from parallel.cpu_compat import enable_cpu_compat
from parallel.host_allocator import keep_freed_memory


class ParallelLayoutError(ValueError):
    """The requested (tp, pp, vpp) layout cannot be built from the launched processes."""


@dataclass(frozen=True)
class Mesh:
    world_size: int
    rank: int
    local_rank: int
    tp: int
    pp: int
    dp: int
    vpp: int | None
    tp_rank: int
    pp_rank: int
    dp_rank: int
    is_first_stage: bool
    is_last_stage: bool
    ep: int = 1
    etp: int = 1
    ep_rank: int = 0
    etp_rank: int = 0

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return parallel_state.get_tensor_model_parallel_group()

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return parallel_state.get_pipeline_model_parallel_group()

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return parallel_state.get_data_parallel_group()

    @property
    def ep_group(self) -> dist.ProcessGroup:
        """The ranks holding the different experts of one expert replica."""
        return parallel_state.get_expert_model_parallel_group()

    @property
    def etp_group(self) -> dist.ProcessGroup:
        """The ranks holding the shards of one routed expert (the TP group of experts)."""
        return parallel_state.get_expert_tensor_parallel_group()

    def last_stage_global_rank(self) -> int:
        """Global rank of the last pipeline stage in this rank's pipeline (same TP / DP rank)."""
        return parallel_state.get_pipeline_model_parallel_last_rank()

    def broadcast_from_last_stage(self, tensor: torch.Tensor) -> torch.Tensor:
        """Overwrite `tensor` on every stage with the last stage's values (any shape; every
        stage must pass a tensor of the same shape and dtype). Returns `tensor`."""
        if self.pp > 1:
            dist.broadcast(tensor, src=self.last_stage_global_rank(), group=self.pp_group)
        return tensor

    def broadcast_object_from_last_stage(self, obj: Any) -> Any:
        """The last stage's `obj` (picklable), returned on every stage of this pipeline."""
        if self.pp == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.last_stage_global_rank(), group=self.pp_group)
        return box[0]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _check_expert_layout(world_size: int, tp: int, pp: int, ep: int, etp: int) -> None:
    if ep < 1 or etp < 1:
        raise ParallelLayoutError(
            f"parallel.ep and parallel.expert_tp must be >= 1 (got ep={ep}, expert_tp={etp})"
        )
    per_stage = world_size // pp
    if per_stage % (ep * etp):
        dp = world_size // (tp * pp)
        raise ParallelLayoutError(
            f"parallel.ep={ep} x parallel.expert_tp={etp} = {ep * etp} must divide the "
            f"{per_stage} ranks of a pipeline stage (tp={tp} x dp={dp}): with expert_tp = tp, "
            f"parallel.ep must divide the data-parallel size {dp}"
        )


def _check_layout(world_size: int, tp: int, pp: int, vpp: int | None) -> None:
    where = f"(parallel.tp={tp}, parallel.pp={pp})"
    if tp < 1 or pp < 1:
        raise ParallelLayoutError(f"tp and pp must be >= 1 {where}")
    if world_size % (tp * pp) != 0:
        raise ParallelLayoutError(
            f"world size {world_size} is not divisible by tp*pp = {tp * pp} {where}; "
            f"launch a multiple of {tp * pp} processes or change parallel.tp / parallel.pp"
        )
    if vpp is not None and (vpp < 1 or (vpp > 1 and pp < 2)):
        raise ParallelLayoutError(
            f"parallel.vpp={vpp} needs parallel.pp >= 2 (got pp={pp}); set parallel.vpp to null"
        )


def init_parallel(
    tp: int = 1,
    pp: int = 1,
    vpp: int | None = None,
    seed: int = 1234,
    timeout_s: int = 1800,
    ep: int = 1,
    etp: int | None = None,
) -> Mesh:
    """Initialise torch.distributed and megatron-core parallel state; see the module docstring.

    Raises ParallelLayoutError when world_size is not a multiple of tp * pp, or the expert
    layout (ep x etp) does not fit the ranks of a pipeline stage.
    """
    if vpp == 1:
        vpp = None  # one virtual stage per rank is plain pipelining
    if dist.is_initialized():
        world_size = dist.get_world_size()
    else:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    _check_layout(world_size, tp, pp, vpp)
    etp = tp if etp is None else etp
    _check_expert_layout(world_size, tp, pp, ep, etp)

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        backend = "nccl"
    else:
        enable_cpu_compat()
        keep_freed_memory()  # a CPU step's big tensors would otherwise be re-faulted each step
        backend = "gloo"
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # plain `python script.py`: a world of one
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        distributed_timeout_minutes=max(1, math.ceil(timeout_s / 60)),
    )
    model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)  # after megatron's seeding, which moves the CPU stream on CPU

    return Mesh(
        world_size=world_size,
        rank=dist.get_rank(),
        local_rank=local_rank,
        tp=tp,
        pp=pp,
        dp=world_size // (tp * pp),
        vpp=vpp,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        is_first_stage=parallel_state.is_pipeline_first_stage(ignore_virtual=True),
        is_last_stage=parallel_state.is_pipeline_last_stage(ignore_virtual=True),
        ep=ep,
        etp=etp,
        ep_rank=parallel_state.get_expert_model_parallel_rank(),
        etp_rank=parallel_state.get_expert_tensor_parallel_rank(),
    )


def destroy_parallel() -> None:
    """Tear down megatron parallel state and the default process group (safe to call twice)."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def rng_tracker_states() -> dict[str, torch.Tensor]:
    """megatron's named RNG streams (`get_cuda_rng_tracker`: per-TP-rank dropout, e.g. a LoRA
    adapter's on a TP-split input), copied; empty before `init_parallel`. A checkpoint keeps
    them so a resumed run draws the masks the uninterrupted run would."""
    return {name: state.clone() for name, state in get_cuda_rng_tracker().get_states().items()}


def set_rng_tracker_states(states: dict[str, torch.Tensor]) -> None:
    get_cuda_rng_tracker().set_states({name: state.clone() for name, state in states.items()})
