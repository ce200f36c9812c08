"""Test-only rank for test_process_lifetime.py: a "training loop" of 0.5 s steps that holds the
trainer's ``StopRequest`` and agrees on stopping after each step, as the trainer does."""

import sys
import time

import torch
import torch.distributed as dist

from rlcli.process_lifetime import StopRequest, tie_rank_to_agent

if __name__ == "__main__":
    tie_rank_to_agent()
    dist.init_process_group("gloo")
    stop = StopRequest()
    model = torch.nn.Linear(1, 1)
    for step in range(1, 240):
        time.sleep(0.5)
        print(f"rank {dist.get_rank()} step {step}", flush=True)
        if stop.agreed([model]):
            print(f"rank {dist.get_rank()} stopped after step {step} ({stop.reason})", flush=True)
            break
    dist.destroy_process_group()
    sys.exit(0)
