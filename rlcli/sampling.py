"""The step's rollout phase: prompts -> engine samples on every replica -> all ranks -> rewards.

The engines themselves live in ``rlcli.rollout``. Every rank draws the same global batch of
prompts; rollout replica ``r`` of ``R`` (a replica is ``rollout.tp`` ranks sharing one engine)
samples its contiguous slice. The samples are then exchanged ONCE so every rank holds all of
them (they are small: token ids and floats); each training data-parallel rank then takes its own
whole groups (``rlcli.batch.take_dp_share``) and everything after that stays on the rank.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

import algorithms
from parallel import cpu_compat
from rlcli.agent_loop import AgentLoop, agent_loop_for, multi_turn_metrics
from rlcli.batch import Sample, groups_of, split_evenly
from rlcli.config import RLConfig
from rlcli.data import PromptItem
from rlcli.errors import UserError
from rlcli.metrics import Timer
from rlcli.rewards import RewardInput, RewardManager
from rlcli.rollout.base import RolloutEngine, SamplingConfig
from rlcli.trajectory import response_limit

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class ReplicaInfo:
    index: int  # this rank's replica
    count: int  # replicas in the world
    is_leader: bool  # the replica's first rank reports its samples (the others hold the same)


def generate_samples(
    engine: RolloutEngine,
    items: Sequence[PromptItem],
    n: int,
    sampling: SamplingConfig,
    replica: ReplicaInfo,
    group_offset: int = 0,
    agent: AgentLoop | None = None,
) -> list[Sample]:
    """Sample ``n`` responses for each prompt of ``items``; returns ALL replicas' samples, on every
    rank, ordered by prompt. ``group`` numbers prompts from ``group_offset``. With an ``agent``
    (multi-turn rollouts) each response is a whole trajectory (``rlcli.agent_loop``)."""
    mine = split_evenly(list(enumerate(items)), replica.count)[replica.index]
    if agent is not None:
        prompts = [(group_offset + position, item) for position, item in mine]
        return _gathered(agent.run(engine, prompts, n, sampling, replica.index), replica)
    # Called even with no prompts: the ranks of a replica (and vLLM's groups) step together.
    with cpu_compat.suspended():  # the engine never calls megatron-core
        outputs = engine.generate([item.prompt_token_ids for _, item in mine], n, sampling)
    local: list[Sample] = []
    for (position, item), completions in zip(mine, outputs, strict=True):
        for completion in completions:
            local.append(
                Sample(
                    group=group_offset + position,
                    prompt_ids=list(item.prompt_token_ids),
                    response_ids=list(completion.token_ids),
                    engine_log_probs=list(completion.logprobs),
                    finish_reason=completion.finish_reason,
                    item=item,
                )
            )
    return _gathered(local, replica)


def _gathered(local: list[Sample], replica: ReplicaInfo) -> list[Sample]:
    """Every replica leader's ``local`` samples, on every rank, ordered by prompt."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return local
    gathered: list[list[Sample] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local if replica.is_leader else [])
    return sorted((s for part in gathered for s in part or []), key=lambda s: s.group)


def score_samples(
    samples: list[Sample],
    rewards: RewardManager,
    tokenizer: PreTrainedTokenizerBase,
    max_failure_rate: float | None = None,
    step: int | None = None,
    texts: Sequence[str] | None = None,
) -> dict[str, float]:
    """Fill ``score`` / ``extras`` of every sample; returns failure counts as metrics.
    ``texts``: every sample's decoded response, when the caller has decoded them already.

    Collective: every sample is scored exactly once, by one rank (each rank scores its
    contiguous share), and the scores are exchanged, so every rank trains on the same numbers
    even when a reward call times out or is random. When more than ``max_failure_rate`` of the
    samples fail to score, raises a ``UserError`` with the reward's first error.
    """
    world, rank = 1, 0
    if dist.is_available() and dist.is_initialized():
        world, rank = dist.get_world_size(), dist.get_rank()
    mine = split_evenly(samples, world)[rank]
    if texts is None:
        my_texts = tokenizer.batch_decode([s.response_ids for s in mine], skip_special_tokens=True)
    else:
        my_texts = split_evenly(list(texts), world)[rank]
    inputs = [reward_input(s, text) for s, text in zip(mine, my_texts, strict=True)]
    scores: list[float] = []
    extras: dict[str, list] = {}
    stats: dict[str, int] = {"reward/num_failed": 0, "reward/num_timeout": 0}
    first_failure = None
    if inputs:
        scores, extras, stats = rewards.score_batch(inputs)
        first_failure = rewards.first_failure
    local = (
        [float(score) for score in scores],
        [
            {key: values[i] for key, values in extras.items() if values[i] is not None}
            for i in range(len(scores))
        ],
        dict(stats),
        first_failure,
    )
    parts = [local]
    if world > 1:
        parts = [None] * world
        dist.all_gather_object(parts, local)
    totals: dict[str, float] = {}
    failure = None
    index = 0
    for part_scores, part_extras, part_stats, part_failure in parts:
        for score, extra in zip(part_scores, part_extras, strict=True):
            samples[index].score = score
            samples[index].extras = extra
            index += 1
        for key, value in part_stats.items():
            totals[key] = totals.get(key, 0.0) + float(value)
        failure = failure or part_failure
    failed = totals.get("reward/num_failed", 0.0) + totals.get("reward/num_timeout", 0.0)
    if max_failure_rate is not None and samples and failed / len(samples) > max_failure_rate:
        where = f"step {step}: " if step is not None else ""
        raise UserError(
            f"{where}the reward function failed on {int(failed)} of {len(samples)} samples, "
            f"more than reward.max_failure_rate={max_failure_rate}; first error: {failure}. "
            "Fix the reward function (reward.fn, reward.kwargs, reward.timeout_s) or raise "
            "reward.max_failure_rate."
        )
    return totals


def reward_input(sample: Sample, decoded_response: str) -> RewardInput:
    """What the reward sees of a sample: its decoded response; a multi-turn trajectory's
    generated text, with its messages and counts added to ``extra_info``."""
    item, record = sample.item, sample.trajectory
    if record is None:
        return RewardInput(
            data_source=item.data_source,
            solution_str=decoded_response,
            ground_truth=item.ground_truth,
            extra_info=item.extra_info,
        )
    return RewardInput(
        data_source=item.data_source,
        solution_str=record.solution_str,
        ground_truth=item.ground_truth,
        extra_info=record.reward_extra_info(item.extra_info),
    )


def accuracy_of(samples: list[Sample]) -> float:
    """Mean of the reward's ``acc`` field where it gives one, else of ``score > 0``."""
    if not samples:
        return float("nan")
    hits = [float(s.extras.get("acc", s.score > 0)) for s in samples]
    return sum(hits) / len(hits)


def rollout_metrics(samples: list[Sample], max_tokens: int, prefix: str = "") -> dict[str, float]:
    scores = torch.tensor([s.score for s in samples], dtype=torch.float64)
    lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float64)
    clipped = [s.finish_reason == "length" or len(s.response_ids) >= max_tokens for s in samples]
    return {
        f"{prefix}reward/score_mean": scores.mean().item(),
        f"{prefix}reward/score_std": scores.std().item() if len(samples) > 1 else 0.0,
        f"{prefix}reward/accuracy": accuracy_of(samples),
        f"{prefix}response_length/mean": lengths.mean().item(),
        f"{prefix}response_length/max": lengths.max().item(),
        f"{prefix}response_length/clip_ratio": sum(clipped) / len(samples),
    }


@contextmanager
def awake(engine: RolloutEngine) -> Iterator[None]:
    """The engine holds its KV cache only while it generates; on GPU, ``sleep`` hands the memory
    back to Megatron for the log-prob and update phases (a no-op on CPU)."""
    engine.wake_up()
    try:
        yield
    finally:
        engine.sleep()


def sampling_params(
    cfg: RLConfig, eos_token_id: int | None, step: int, train: bool
) -> SamplingConfig:
    """Training sampling (``rollout.*``) or greedy held-out sampling (``rollout.val_*``)."""
    r = cfg.rollout
    return SamplingConfig(
        temperature=r.temperature if train else r.val_temperature,
        top_p=r.top_p if train else 1.0,
        top_k=r.top_k if train else -1,
        max_tokens=r.max_tokens,
        stop_token_ids=sorted(
            {*r.stop_token_ids, *([eos_token_id] if eos_token_id is not None else [])}
        ),
        seed=cfg.trainer.seed * 100_003 + step * 7_919,
    )


def collect_rollouts(
    cfg: RLConfig,
    engine: RolloutEngine,
    replica: ReplicaInfo,
    loader: Iterator[list[PromptItem]],
    rewards: RewardManager,
    tokenizer: PreTrainedTokenizerBase,
    step: int,
    timer: Timer,
) -> tuple[list[Sample], dict[str, float]]:
    """Sample the step's prompts and score them (every rank returns ALL samples).

    With DAPO dynamic sampling only groups whose metric varies are kept, and more prompts are
    drawn until the batch is full (up to ``max_gen_batches`` rounds). All rounds run inside ONE
    awake block: on GPU, ``sleep`` discards the weights at level 2, so waking again would need a
    weight sync first. ReMax's greedy baselines are sampled in the same block.
    """
    dyn = cfg.algorithm.dynamic_sampling
    # With a model reward (its own phases after this one) DAPO's filter runs on the combined
    # reward there (rlcli.model_rewards), not on the rule's score here.
    filtering = dyn.enabled and not cfg.reward.uses_model_reward
    remax = cfg.algorithm.adv_estimator == "remax"
    train = sampling_params(cfg, tokenizer.eos_token_id, step, train=True)
    greedy = sampling_params(cfg, tokenizer.eos_token_id, step, train=False)
    agent = agent_loop_for(cfg, tokenizer)  # None: single-turn
    kept: list[list[Sample]] = []
    metrics: dict[str, float] = {}
    drawn = 0
    with awake(engine):
        for round_index in range(dyn.max_gen_batches if filtering else 1):
            items = next(loader)
            with timer("gen"):
                samples = generate_samples(
                    engine, items, cfg.rollout.n, train, replica, drawn, agent
                )
                baselines = (
                    generate_samples(engine, items, 1, greedy, replica, drawn, agent)
                    if remax
                    else []
                )
            drawn += len(items)
            with timer("reward"):
                limit = cfg.reward.max_failure_rate
                reward_stats = score_samples(samples, rewards, tokenizer, limit, step)
                if remax:  # the baseline: each prompt's greedy answer's score
                    score_samples(baselines, rewards, tokenizer, limit, step)
                    baseline = {b.group: b.score for b in baselines}
                    for s in samples:
                        s.reward_baseline = baseline[s.group]
            if round_index == 0:
                metrics.update(rollout_metrics(samples, response_limit(cfg)))
                metrics.update(reward_stats)
                metrics.update(multi_turn_metrics(samples))
            groups = groups_of(samples)
            if filtering:
                groups = informative_groups(samples, dyn.metric)
            kept.extend(groups)
            if len(kept) >= cfg.data.train_batch_size:
                break
    if filtering:
        metrics["dapo/kept_groups_ratio"] = len(kept) / max(drawn, 1)
        metrics["dapo/gen_batches"] = float(round_index + 1)
    kept = kept[: cfg.data.train_batch_size]
    return [s for g in kept for s in g], metrics


def filter_metric(sample: Sample, name: str) -> float:
    """DAPO's filter value of a sample: the reward field ``name`` (e.g. ``acc``), else its score."""
    return float(sample.extras.get(name, sample.score))


def informative_groups(samples: list[Sample], metric: str) -> list[list[Sample]]:
    """DAPO dynamic sampling: the groups whose ``metric`` varies (the others carry no signal)."""
    values = torch.tensor([filter_metric(s, metric) for s in samples])
    keep, _ = algorithms.filter_groups(values, torch.tensor([s.group for s in samples]))
    keep_ids = {s.group for s, k in zip(samples, keep.tolist(), strict=True) if k}
    return [g for g in groups_of(samples) if g[0].group in keep_ids]


def evaluate(
    cfg: RLConfig,
    engine: RolloutEngine,
    replica: ReplicaInfo,
    data: Sequence[PromptItem],
    rewards: RewardManager,
    tokenizer: PreTrainedTokenizerBase,
    step: int,
) -> dict[str, float]:
    """Held-out accuracy: greedy (``rollout.val_temperature``) answers to ``data``, scored."""
    start = time.perf_counter()
    with awake(engine):
        samples = generate_samples(
            engine,
            list(data),
            cfg.rollout.val_n,
            sampling_params(cfg, tokenizer.eos_token_id, step, train=False),
            replica,
            agent=agent_loop_for(cfg, tokenizer),
        )
    score_samples(samples, rewards, tokenizer, cfg.reward.max_failure_rate, step)
    metrics = rollout_metrics(samples, response_limit(cfg), prefix="val/")
    metrics.update(multi_turn_metrics(samples, prefix="val/"))
    metrics["val/num_prompts"] = float(len(data))
    metrics["timing/val"] = time.perf_counter() - start
    return metrics
