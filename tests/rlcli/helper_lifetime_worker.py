"""Test-only rank for test_process_lifetime.py: makes one real megatron-core dist_checkpointing save
(which starts its checkpoint-writer Manager: spawned on GPU, forked on CPU), writes its own pid and its helper
processes' pids and command lines to OUT_JSON, then waits to be killed.

Imports ``rlcli.cli`` as the ``rlcli`` entry point does, and under torchrun ties itself to the
agent as ``rlcli.cli.main`` does; a spawned Manager runs this script again as ``__mp_main__``
and so imports ``rlcli.cli`` too, a forked one runs the after-fork hook that import registered."""

import json
import os
import sys
import time

import psutil
import torch

import rlcli.cli  # noqa: F401  (what ties spawn children to their parent)
from rlcli.commands.relaunch import under_torchrun
from rlcli.process_lifetime import tie_rank_to_agent


def main(out_json: str, checkpoint_dir: str) -> None:
    if under_torchrun():
        tie_rank_to_agent()
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    from parallel.cpu_compat import enable_cpu_compat

    enable_cpu_compat()

    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{checkpoint_dir}.store", rank=0, world_size=1
    )
    os.makedirs(checkpoint_dir, exist_ok=True)
    state = {"weight": ShardedTensor.from_rank_offsets("weight", torch.arange(16.0))}
    dist_checkpointing.save(state, checkpoint_dir)
    helpers = [
        {"pid": child.pid, "cmdline": " ".join(child.cmdline())}
        for child in psutil.Process().children(recursive=True)
    ]
    with open(f"{out_json}.tmp", "w") as handle:
        json.dump({"rank": os.getpid(), "helpers": helpers}, handle)
    os.replace(f"{out_json}.tmp", out_json)
    time.sleep(600)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
