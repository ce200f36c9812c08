"""The RL loop. Every rank runs the same code (SPMD under torchrun); ``rl_step`` is the whole
algorithm on one screen: generate, reward, log-probs, advantages, update, sync."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import algorithms
from rlcli import components as comp
from rlcli.batch import Sample, balance_groups, collate, groups_of
from rlcli.config import RLConfig
from rlcli.generation import generate_samples, rollout_metrics, score_samples
from rlcli.metrics import Timer
from rlcli.ppo import compute_advantages, update_actor
from rlcli.rollout.base import SamplingConfig
from rlcli.rollout.metrics import logprob_mismatch


@dataclass
class Run:
    c: comp.Components
    actor: Any
    ref: Any
    engine: Any
    replica: Any
    rewards: Any
    loader: Any
    kl_ctrl: Any
    total_steps: int
    step: int = 0

    @property
    def cfg(self) -> RLConfig:
        return self.c.cfg


def rl_step(run: Run) -> dict[str, float]:
    """One training step (DESIGN.md): each phase one call, timed."""
    cfg, mesh, timer = run.cfg, run.c.mesh, Timer()
    with timer("step"):
        samples, gen_metrics = collect_rollouts(run, timer)  # times "gen" and "reward"
        parts = balance_groups(groups_of(samples), mesh.dp)  # the same on every rank
        fewest_groups = min(len(part) for part in parts)
        if fewest_groups == 0:  # DAPO kept fewer informative groups than there are DP ranks
            return {**gen_metrics, **timer.metrics(), "actor/skipped_update": 1.0}
        with timer("gather"):
            local = parts[mesh.dp_rank]
            batch = collate([s for group in local for s in group], run.c.tokenizer.pad_token_id)
        mbs = cfg.actor.micro_batch_size
        with timer("old_log_prob"):
            batch["old_log_probs"] = run.actor.log_probs(batch, mbs, cfg.rollout.temperature or 1.0)
        if run.ref is not None:
            with timer("ref"):
                run.ref.onload()
                batch["ref_log_probs"] = run.ref.log_probs(
                    batch, mbs, cfg.rollout.temperature or 1.0
                )
                run.ref.offload()
        with timer("adv"):
            global_batch = all_gather_batch(batch, mesh)
            adv_metrics = compute_advantages(global_batch, cfg, run.kl_ctrl)
            batch.update(take_local(global_batch, batch, mesh.dp_rank))
        with timer("update"):
            update_metrics = update_actor(run.actor, batch, cfg, mesh, fewest_groups)
        with timer("sync"):
            sync_metrics = sync_weights(run)
    metrics = {**gen_metrics, **adv_metrics, **update_metrics, **sync_metrics}
    metrics.update(
        logprob_mismatch(
            global_batch["engine_logprobs"],
            global_batch["old_log_probs"],
            global_batch["response_mask"],
        )
    )
    metrics.update(kl_metrics(global_batch, run))
    metrics.update(timer.metrics())
    tokens = float(global_batch["attention_mask"].sum())
    metrics["perf/tokens_per_s"] = tokens / max(metrics["timing/step"], 1e-9)
    metrics["perf/peak_memory_gb"] = peak_memory_gb()
    return metrics


def collect_rollouts(run: Run, timer: Timer) -> tuple[list[Sample], dict[str, float]]:
    """Sample the step's prompts and score them; with DAPO dynamic sampling keep only groups
    whose metric varies and draw more prompts until the batch is full (up to a limit)."""
    cfg = run.cfg
    dyn = cfg.algorithm.dynamic_sampling
    want = cfg.data.train_batch_size
    kept: list[list[Sample]] = []
    metrics: dict[str, float] = {}
    drawn = kept_groups = 0
    for round_index in range(dyn.max_gen_batches if dyn.enabled else 1):
        items = next(run.loader)
        with timer("gen"), awake(run.engine):
            samples = generate_samples(
                run.engine,
                items,
                cfg.rollout.n,
                sampling_for(run, train=True),
                run.replica,
                group_offset=drawn,
            )
            if cfg.algorithm.adv_estimator == "remax":  # baseline: each prompt's greedy answer
                greedy = generate_samples(
                    run.engine, items, 1, sampling_for(run, train=False), run.replica, drawn
                )
        drawn += len(items)
        with timer("reward"):
            reward_stats = score_samples(samples, run.rewards, run.c.tokenizer)
            if cfg.algorithm.adv_estimator == "remax":
                score_samples(greedy, run.rewards, run.c.tokenizer)
                baseline = {g.group: g.score for g in greedy}
                for s in samples:
                    s.extras["reward_baseline"] = baseline[s.group]
        if round_index == 0:
            metrics.update(rollout_metrics(samples, cfg.rollout.max_tokens))
            metrics.update(reward_stats)
        groups = groups_of(samples)
        if dyn.enabled:
            values = torch.tensor([float(s.extras.get(dyn.metric, s.score)) for s in samples])
            keep, _ = algorithms.filter_groups(values, torch.tensor([s.group for s in samples]))
            keep_ids = {s.group for s, k in zip(samples, keep.tolist(), strict=True) if k}
            groups = [g for g in groups if g[0].group in keep_ids]
        kept_groups += len(groups)
        kept.extend(groups)
        if len(kept) >= want:
            break
    if dyn.enabled:
        metrics["dapo/kept_groups_ratio"] = kept_groups / max(drawn, 1)
        metrics["dapo/gen_batches"] = float(round_index + 1)
    kept = kept[:want]
    return [s for g in kept for s in g], metrics


@contextmanager
def awake(engine):
    """The engine holds its KV cache only while it generates; on GPU, ``sleep`` hands the memory
    back to Megatron for the log-prob and update phases (a no-op on CPU)."""
    engine.wake_up()
    try:
        yield
    finally:
        engine.sleep()


def sampling_for(run: Run, train: bool) -> SamplingConfig:
    r = run.cfg.rollout
    eos = run.c.tokenizer.eos_token_id
    return SamplingConfig(
        temperature=r.temperature if train else r.val_temperature,
        top_p=r.top_p if train else 1.0,
        top_k=r.top_k if train else -1,
        max_tokens=r.max_tokens,
        stop_token_ids=sorted({*r.stop_token_ids, *([eos] if eos is not None else [])}),
        seed=run.cfg.trainer.seed * 100_003 + run.step * 7_919,
    )


def all_gather_batch(batch: dict[str, torch.Tensor], mesh) -> dict[str, torch.Tensor]:
    """Concatenate every DP rank's batch (padding R and S to the longest) in DP-rank order."""
    if mesh.dp == 1:
        return dict(batch)
    parts: list[Any] = [None] * mesh.dp
    dist.all_gather_object(parts, {k: v.cpu() for k, v in batch.items()}, group=mesh.dp_group)
    out = {}
    for key in batch:
        tensors = [p[key] for p in parts]
        width = max(t.shape[1] for t in tensors) if tensors[0].dim() == 2 else None
        if width is not None:
            tensors = [torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in tensors]
        out[key] = torch.cat(tensors)
    out["_dp_sizes"] = torch.tensor([p["input_ids"].shape[0] for p in parts])
    return out


def take_local(
    global_batch: dict[str, torch.Tensor], local: dict[str, torch.Tensor], dp_rank: int
) -> dict[str, torch.Tensor]:
    """This DP rank's rows of the per-sample results computed on the global batch."""
    sizes = global_batch.get("_dp_sizes")
    start = 0 if sizes is None else int(sizes[:dp_rank].sum())
    rows, width = local["input_ids"].shape[0], local["response_mask"].shape[1]
    keys = ("token_level_rewards", "advantages", "returns")
    return {k: global_batch[k][start : start + rows, :width] for k in keys}


def sync_weights(run: Run) -> dict[str, float]:
    """Stream the new weights into the engine's layout (``parallel.reshard``)."""
    from parallel.reshard import sync_weights as reshard_and_load

    stats = reshard_and_load(
        run.actor.models, run.c.mesh, run.engine, run.cfg.rollout.sync_bucket_mb
    )
    return {
        "sync/bytes_gb": stats.bytes / 1e9,
        "sync/gbps": stats.gbps,
        "sync/buckets": float(stats.num_buckets),
    }


def kl_metrics(batch: dict[str, torch.Tensor], run: Run) -> dict[str, float]:
    if "ref_log_probs" not in batch:
        return {}
    kind = run.cfg.actor.kl_loss_type if run.cfg.actor.use_kl_loss else run.cfg.algorithm.kl_penalty
    kl = algorithms.kl_penalty(batch["old_log_probs"], batch["ref_log_probs"], kind)
    # The reward-KL controller itself is updated by apply_kl_penalty_to_rewards (once per step).
    return {"actor/kl_to_ref": algorithms.masked_mean(kl, batch["response_mask"]).item()}


def peak_memory_gb() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB


def validate(run: Run) -> dict[str, float]:
    """Greedy (``rollout.val_temperature``) accuracy on the held-out prompts."""
    data = run.c.val_data
    if data is None:
        return {}
    start = time.perf_counter()
    with awake(run.engine):
        samples = generate_samples(
            run.engine,
            list(data),
            run.cfg.rollout.val_n,
            sampling_for(run, train=False),
            run.replica,
        )
    score_samples(samples, run.rewards, run.c.tokenizer)
    metrics = rollout_metrics(samples, run.cfg.rollout.max_tokens, prefix="val/")
    metrics["val/num_prompts"] = float(len(data))
    metrics["timing/val"] = time.perf_counter() - start
    return metrics
