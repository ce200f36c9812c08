"""What the benchmark's sections share: the seed, the device, and timing steps."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

import torch

SEED = 1234


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def random_token_ids(rows: int, length: int, vocab_size: int, seed: int) -> torch.Tensor:
    """[rows, length] int64 ids below vocab_size - 1 (the workload models' EOS is the last id)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size - 1, (rows, length), generator=generator)


def time_steps(step: Callable[[], None], count: int, warmup: int = 1) -> list[float]:
    """Seconds of `count` calls of `step`, after `warmup` untimed calls."""
    for _ in range(warmup):
        step()
    seconds = []
    for _ in range(count):
        synchronize()
        start = time.perf_counter()
        step()
        synchronize()
        seconds.append(time.perf_counter() - start)
    return seconds


def len_unique_params(models: list[torch.nn.Module]) -> int:
    """Parameters held by `models`, a shared (tied) tensor counted once."""
    seen = {id(p): p.numel() for model in models for p in model.parameters()}
    return sum(seen.values())
