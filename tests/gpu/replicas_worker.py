"""Under torchrun with 4 ranks and rollout.tp=2: two vLLM replicas of two TP ranks each.
Replica 0 generates three times; replica 1 never calls generate. Independent replicas finish;
replicas fused into one vLLM data-parallel group would wait for each other and hang.

    python -m torch.distributed.run --standalone --nproc_per_node 4 replicas_worker.py MODEL_DIR
"""

from __future__ import annotations

import sys
from datetime import timedelta

import torch.distributed as dist

from rlcli.config.schema import RolloutConfig
from rlcli.process_lifetime import exit_skipping_teardown
from rlcli.rollout import SamplingConfig, make_engine


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    section = RolloutConfig(engine="vllm", tp=2, kv_cache_gb=0.05, load_format="auto")
    engine = make_engine(section, sys.argv[1], max_model_len=128)
    replica = engine.replica.index
    sampling = SamplingConfig(temperature=1.0, max_tokens=6, seed=3)
    lengths = []
    if replica == 0:
        for _ in range(3):
            lengths.append(len(engine.generate([[5, 17, 42], [9, 9]], 2, sampling)))
    print(
        f"rank {dist.get_rank()} replica {replica} of {engine.replica.count}: {lengths}", flush=True
    )
    dist.barrier()  # replica 1 waits here while replica 0 generates
    print(f"rank {dist.get_rank()} done", flush=True)
    engine.close()  # last: vLLM's shutdown destroys the default group


if __name__ == "__main__":
    main()
    exit_skipping_teardown()  # (2 s of interpreter teardown a rank)
