"""Checks 3 and 6: weight sync into the rollout engine, and memory through RL phases."""

from __future__ import annotations

import torch

from tests.gpu.common import (
    Context,
    hf_config_of,
    make_actor,
    nll_loss,
    step,
    synchronize,
    timed,
    token_batch,
    used_memory_gb,
)

# bf16 tolerance for trainer-vs-engine sampled-token log-probs (two bf16 implementations of the
# same weights): mean |d| below this. fp32 runs agree to ~1e-5; bf16 rounding of logits of
# magnitude ~10 alone gives ~0.03 per token.
LOGPROB_MEAN_TOLERANCE = 0.05


def _trainer_vs_engine(ctx: Context, actor, engine, vocab: int) -> tuple[float, float, int]:
    """Sample with the engine, score the samples with Megatron: (mean, max |d log-prob|, n)."""
    from parallel.forward_passes import forward_log_probs
    from rlcli.rollout import SamplingConfig

    generator = torch.Generator().manual_seed(5)
    prompts = torch.randint(1, vocab, (4, 12), generator=generator).tolist()
    sampling = SamplingConfig(temperature=1.0, max_tokens=24, seed=7)
    results = engine.generate(prompts, 2, sampling)
    rows, engine_lp, spans = [], [], []
    for prompt, samples in zip(prompts, results, strict=True):
        for sample in samples:
            rows.append(prompt + sample.token_ids)
            engine_lp.append(sample.logprobs)
            # The log-prob of token t sits at position t - 1 of the trainer's output.
            spans.append((len(prompt) - 1, len(sample.token_ids)))
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    with torch.no_grad():
        trainer_lp = forward_log_probs(
            actor.models, ctx.mesh, ids.to(ctx.device), mask.to(ctx.device), micro_batch_size=4
        ).cpu()
    flat = torch.cat(
        [
            (trainer_lp[i, start : start + count] - torch.tensor(engine_lp[i])).abs()
            for i, (start, count) in enumerate(spans)
        ]
    )
    return float(flat.mean()), float(flat.max()), flat.numel()


def copy_floor_gbps(num_bytes: int) -> float:
    """GB/s of one device-to-device copy of the same bytes (bytes counted once)."""
    source = torch.empty(num_bytes, dtype=torch.uint8, device=torch.device(_device_name()))
    target = torch.empty_like(source)
    seconds = timed(lambda: target.copy_(source), repeats=5, warmup=2)
    return num_bytes / seconds / 1e9


def _device_name() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_engine_sync(ctx: Context) -> tuple[bool, str]:
    """Megatron (trained away from the engine's weights) -> sync -> the engine's sampled-token
    log-probs agree with Megatron's; before the sync they do not. GB/s against the copy floor."""
    from parallel.reshard import sync_weights

    kind = ctx.engine
    hf_config = hf_config_of(ctx.small_model_dir)
    vocab = hf_config.vocab_size
    actor = make_actor(ctx, hf_config, model_dir=ctx.small_model_dir, distributed_optimizer=True)
    batch = token_batch(ctx, vocab, 8, 64, micro=4, seed=3)
    for _ in range(3):
        step(ctx, actor, batch)  # lr 1e-3: the actor now differs from the files the engine read
    engine = ctx.rollout_engine()
    dummy_start = engine.needs_weight_sync  # vLLM on GPU starts without reading the checkpoint
    before = None if dummy_start else _trainer_vs_engine(ctx, actor, engine, vocab)[0]
    engine.sleep()
    stats = sync_weights(actor.models, ctx.mesh, engine, bucket_mb=64)
    engine.wake_up()
    mean, worst, count = _trainer_vs_engine(ctx, actor, engine, vocab)
    floor = copy_floor_gbps(stats.bytes)
    ok = mean < LOGPROB_MEAN_TOLERANCE and (before is None or before > 2 * mean)
    first = "dummy weights (first sync loads them)" if before is None else f"mean {before:.2e}"
    return ok, (
        f"engine={kind}; after sync mean|dlogp| {mean:.2e} max {worst:.2e} over {count} sampled "
        f"tokens (bf16 tolerance mean < {LOGPROB_MEAN_TOLERANCE}); before sync {first}; "
        f"sync {stats.bytes / 1e6:.1f} MB in {stats.num_buckets} bucket(s), {stats.seconds * 1e3:.1f} ms "
        f"= {stats.gbps:.1f} GB/s vs device copy floor {floor:.0f} GB/s "
        f"({stats.gbps / floor * 100:.1f}% of floor)"
    )


def check_memory_phases(ctx: Context) -> tuple[bool, str]:
    """generate -> sleep -> log-probs -> update -> sync -> wake, three cycles; the memory in use
    after each phase (cudaMemGetInfo; RSS on CPU) must not grow from cycle to cycle."""
    from parallel.forward_passes import forward_log_probs
    from parallel.reshard import sync_weights
    from rlcli.rollout import SamplingConfig

    kind = ctx.engine
    hf_config = hf_config_of(ctx.small_model_dir)
    vocab = hf_config.vocab_size
    actor = make_actor(ctx, hf_config, model_dir=ctx.small_model_dir, distributed_optimizer=True)
    engine = ctx.rollout_engine()
    if engine.needs_weight_sync:  # dummy start, when check 3 did not run
        sync_weights(actor.models, ctx.mesh, engine, bucket_mb=64)
    sampling = SamplingConfig(temperature=1.0, max_tokens=32, seed=1)
    prompts = torch.randint(1, vocab, (8, 16), generator=torch.Generator().manual_seed(2)).tolist()
    cycles: list[dict[str, float]] = []
    for _cycle in range(3):
        used = {}
        results = engine.generate(prompts, 4, sampling)
        used["generate"] = used_memory_gb()
        engine.sleep()
        used["sleep"] = used_memory_gb()
        rows = [
            p + s.token_ids for p, samples in zip(prompts, results, strict=True) for s in samples
        ]
        width = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row)
        mask = (ids != 0).long()
        ids, mask = ids.to(ctx.device), mask.to(ctx.device)
        with torch.no_grad():
            forward_log_probs(actor.models, ctx.mesh, ids, mask, micro_batch_size=8)
        used["log-probs"] = used_memory_gb()
        from parallel.step_types import MicroBatch

        micro = [
            MicroBatch(input_ids=i, attention_mask=m)
            for i, m in zip(ids.split(8), mask.split(8), strict=True)
        ]
        from parallel.optim import train_step

        train_step(actor.models, ctx.mesh, actor.optimizer, actor.scheduler, micro, nll_loss)
        used["update"] = used_memory_gb()
        sync_weights(actor.models, ctx.mesh, engine, bucket_mb=64)
        used["sync"] = used_memory_gb()
        engine.wake_up()
        synchronize()
        used["wake"] = used_memory_gb()
        cycles.append(used)
    margin = 0.25 if torch.cuda.is_available() else 0.3  # GB: allocator / RSS noise
    # Cycle 1 makes the one-time allocations (optimizer state at the first update, the
    # allocator's pools); from cycle 2 to cycle 3 nothing may grow.
    growth = max(cycles[2][p] - cycles[1][p] for p in cycles[0])
    first = max(cycles[2][p] - cycles[0][p] for p in cycles[0])
    ok = growth <= margin
    table = "; ".join(
        f"cycle {i + 1}: " + " ".join(f"{p} {gb:.2f}" for p, gb in used.items())
        for i, used in enumerate(cycles)
    )
    what = "GB in use (mem_get_info)" if torch.cuda.is_available() else "GB RSS"
    return (
        ok,
        f"engine={kind}; {what}: {table}; growth cycle 2 -> 3 {growth:+.2f} GB (limit {margin}), cycle 1 -> 3 {first:+.2f} GB",
    )
