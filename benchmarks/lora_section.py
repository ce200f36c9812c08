"""The benchmark's lora section: a LoRA actor against full fine-tuning, on the train section's model
and batch.

    update  the actor update with rank-`lora_rank` adapters on every linear (the base frozen):
            tokens/s and peak memory (CPU RSS / GPU allocated), measured as the train section
            measures full fine-tuning's Megatron update, first thing in a fresh process
    sync    the LoRA actor's weight sync into vLLM through the trainer's own transports
            (rlcli.rollout.transport): merged (W + alpha/r * B A of every tensor) against
            adapter (only A and B move; vLLM applies them), best of `sync_repeats`
"""

from __future__ import annotations

import importlib.util
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import (
    SEED,
    device,
    free_memory,
    len_unique_params,
    random_token_ids,
)
from benchmarks.memory import measure_peak_memory
from benchmarks.train_section import megatron_actor, nll_loss, time_update
from benchmarks.workload import Workload, ensure_model


def lora_section(workload: Workload, work_dir: Path) -> dict:
    from parallel.lora import LoraSpec
    from parallel.mesh import destroy_parallel, init_parallel
    from parallel.step_types import MicroBatch

    w = workload
    model_dir = ensure_model(w.train_model, work_dir / "models", w.dtype)
    rows = w.train_micro_batches * w.train_micro_batch_size
    ids = random_token_ids(rows, w.train_seq_len, w.train_model.vocab_size, SEED).to(device())
    batch = MicroBatch(input_ids=ids, attention_mask=torch.ones_like(ids))  # the train section's
    spec = LoraSpec(rank=w.lora_rank, alpha=2.0 * w.lora_rank, target_modules=("all",))
    with measure_peak_memory() as memory:
        mesh = init_parallel(tp=1, pp=1, seed=SEED)
        actor = megatron_actor(mesh, model_dir, w.dtype, w.train_micro_batch_size,
                               w.train_warmup_steps + w.train_steps, lora=spec)  # fmt: skip
        steps = time_update(
            lambda: actor.train_step(batch, nll_loss), w.train_steps, w.train_warmup_steps
        )
        free_memory()
    trainable = {id(p): p.numel() for m in actor.models for p in m.parameters() if p.requires_grad}
    tokens_per_step = rows * w.train_seq_len
    result: dict = {
        "model": w.train_model.name,
        "rank": spec.rank,
        "targets": list(spec.targets()),
        "params": len_unique_params(actor.models),
        "trainable_params": sum(trainable.values()),
        "tokens_per_step": tokens_per_step,
        "dtype": w.dtype,
        "update": {
            "step_seconds": steps.seconds,
            "warmup_step_seconds": steps.warmup_seconds,
            # the median step, as the train section's
            "tokens_per_s": tokens_per_step / statistics.median(steps.seconds),
            "memory": memory.to_dict(),
        },
    }
    if importlib.util.find_spec("vllm") is not None:
        result["sync"] = _sync_times(actor, mesh, model_dir, w)
    destroy_parallel()
    return result


def _sync_times(actor, mesh, model_dir: Path, w: Workload) -> dict:
    """Seconds and bytes of the two LoRA syncs into one vLLM engine that takes adapters."""
    from rlcli.config.schema import RolloutConfig
    from rlcli.rollout import make_engine
    from rlcli.rollout.transport import InProcessAdapterTransport, InProcessTransport

    rollout = RolloutConfig(engine="vllm", kv_cache_gb=0.05, load_format="auto")
    engine = make_engine(rollout, str(model_dir), dtype=w.dtype, max_model_len=128,
                         max_lora_rank=actor.lora.rank)  # fmt: skip
    transports = {
        "adapter": InProcessAdapterTransport(engine, w.sync_bucket_mb),
        "merged": InProcessTransport(engine, w.sync_bucket_mb),
    }
    out = {}
    for name, transport in transports.items():
        runs = []
        for _ in range(w.sync_repeats + 1):  # the first call warms up
            start = time.perf_counter()
            stats = transport.sync(actor.models, mesh)
            runs.append((time.perf_counter() - start, stats.bytes))
        seconds = min(s for s, _ in runs[1:] or runs)
        out[name] = {"seconds": seconds, "bytes": runs[-1][1], "gbps": runs[-1][1] / seconds / 1e9}
        transport.close()
    engine.close()
    out["adapter_over_merged"] = out["merged"]["seconds"] / out["adapter"]["seconds"]
    return out
