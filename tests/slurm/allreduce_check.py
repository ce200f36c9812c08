"""A tiny torch.distributed program for launcher tests: every rank all-reduces rank + 1 (gloo).

Prints one line per rank, ``allreduce rank=R world=W sum=S``, where S must be W * (W + 1) / 2.
"""

import os
import socket

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    local_rank = os.environ["LOCAL_RANK"]
    print(
        f"allreduce rank={rank} world={world} sum={value.item():g} "
        f"local_rank={local_rank} host={socket.gethostname()}",
        flush=True,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
