"""The step's rollout phase: prompts -> engine samples on every replica -> all ranks -> rewards.

    sampler = build_sampler(inputs, rewards, agent)      # rlcli.train.build_rollouts, once per run
    samples, metrics = sampler.collect(loader, step, timer)     # the step's scored samples
    metrics = sampler.evaluate(val_data, step)                  # held-out accuracy

A ``Sampler`` is the rollout side of a run, built once and used by both placements (the
colocated trainer's ``rlcli.rollout.placement.ColocatedRollouts`` and the separate placement's
``rlcli.rollout.worker.RolloutWorker``): this rank's engine (``rlcli.rollout``; its ``replica``),
the rule reward, the tokenizer and, with multi-turn rollouts, the agent loop.

Every rank draws the same global batch of prompts; rollout replica ``r`` of ``R`` (a replica is
``rollout.tp`` ranks sharing one engine) samples its contiguous slice. The samples are then
exchanged ONCE so every rank holds all of them (they are small: token ids and floats); each
training data-parallel rank then takes its own whole groups (``rlcli.rollout.batch.take_dp_share``) and
everything after that stays on the rank.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from parallel import cpu_compat
from rlcli.config.schema import RLConfig
from rlcli.data import PromptItem
from rlcli.errors import UserError
from rlcli.rewards import RewardInput, RewardManager
from rlcli.rollout.agent_loop import AgentLoop, multi_turn_metrics
from rlcli.rollout.agents.runner import AgentRollout
from rlcli.rollout.agents.stats import AgentStats
from rlcli.rollout.base import ReplicaInfo, RolloutEngine, SamplingConfig, awake
from rlcli.rollout.batch import Sample, split_evenly
from rlcli.rollout.dynamic_sampling import informative_groups
from rlcli.rollout.trajectory import response_limit
from rlcli.run.metrics import Timer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class Sampler:
    """This rank's rollout side (module docstring). Every method that samples is collective over
    the engines' world: every rank calls it with the same arguments."""

    cfg: RLConfig
    engine: RolloutEngine
    rewards: RewardManager  # the rule reward (reward.fn)
    tokenizer: PreTrainedTokenizerBase
    agent: AgentLoop | None = None  # multi-turn rollouts (rollout.multi_turn.enable)
    agents: AgentRollout | None = None  # agents written against the OpenAI API (rollout.agent)
    agent_stats: AgentStats | None = None  # the last ``generate``'s, summed over replicas

    @property
    def replica(self) -> ReplicaInfo:
        return self.engine.replica

    def sampling(self, step: int, train: bool) -> SamplingConfig:
        """Training sampling (``rollout.*``) or greedy held-out sampling (``rollout.val_*``)."""
        return sampling_params(self.cfg, self.tokenizer.eos_token_id, step, train)

    def generate(
        self,
        items: Sequence[PromptItem],
        n: int,
        sampling: SamplingConfig,
        group_offset: int = 0,
    ) -> list[Sample]:
        """Sample ``n`` responses for each prompt of ``items`` (the engine awake); returns ALL
        replicas' samples, on every rank, ordered by prompt. ``group`` numbers prompts from
        ``group_offset``. With the agent loop each response is a whole trajectory."""
        replica = self.replica
        mine = split_evenly(list(enumerate(items)), replica.count)[replica.index]
        prompts = [(group_offset + position, item) for position, item in mine]
        if self.agent is not None:
            trajectories = self.agent.run(self.engine, prompts, n, sampling, replica.index)
            return _gathered(trajectories, replica)
        if self.agents is not None:
            local, stats = self.agents.run(self.engine, prompts, n, sampling, replica.index)
            samples, self.agent_stats = _gathered_with_stats(local, stats, replica)
            self.agent_stats.check(self.cfg.rollout.agent_options.max_failure_rate)
            failed = self.agent_stats.failed
            if failed and (not dist.is_initialized() or dist.get_rank() == 0):
                print(
                    f"[rlcli] {failed} of {self.agent_stats.agents} agents failed "
                    f"(rollout.agent_options.on_failure="
                    f"{self.cfg.rollout.agent_options.on_failure}); first: "
                    f"{self.agent_stats.first_error}",
                    flush=True,
                )
            return samples
        # Called even with no prompts: the ranks of a replica (and vLLM's groups) step together.
        with cpu_compat.suspended():  # the engine never calls megatron-core
            outputs = self.engine.generate(
                [item.prompt_token_ids for _, item in mine],
                n,
                sampling,
                images=[item.image_inputs for _, item in mine],
            )
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
                        routing=completion.routing,
                    )
                )
        return _gathered(local, replica)

    def score(
        self, samples: list[Sample], step: int | None = None, texts: Sequence[str] | None = None
    ) -> dict[str, float]:
        """``score_samples`` with the rule reward, held to ``reward.max_failure_rate``. An
        agent's trajectory is scored once: by the agent's reward, else the rule reward of its
        last segment, which its other segments share."""
        limit = self.cfg.reward.max_failure_rate
        if self.agents is None:
            return score_samples(samples, self.rewards, self.tokenizer, limit, step, texts)
        graded = [s for s in samples if _needs_rule_reward(s)]
        metrics = score_samples(graded, self.rewards, self.tokenizer, limit, step)
        share_agent_scores(samples)
        return metrics

    def collect(
        self, loader: Iterator[list[PromptItem]], step: int, timer: Timer
    ) -> tuple[list[Sample], dict[str, float]]:
        """Sample the step's prompts and score them by the rule reward (every rank returns ALL
        samples).

        With DAPO's dynamic sampling more prompts are drawn (``max_gen_batches`` rounds at most)
        until the rounds hold ``data.train_batch_size`` groups whose reward varies; the step's
        filter (``rlcli.rollout.dynamic_sampling``) then keeps those. All rounds run inside ONE awake
        block: on GPU, ``sleep`` discards the weights at level 2, so waking again would need a
        weight sync first. ReMax's greedy baselines are sampled in the same block.
        """
        cfg = self.cfg
        dyn = cfg.algorithm.dynamic_sampling
        remax = cfg.algorithm.adv_estimator == "remax"
        train, greedy = self.sampling(step, train=True), self.sampling(step, train=False)
        samples: list[Sample] = []
        metrics: dict[str, float] = {}
        drawn = informative = 0
        with awake(self.engine):
            for round_index in range(dyn.max_gen_batches if dyn.enabled else 1):
                items = next(loader)
                with timer("gen"):
                    drawn_now = self.generate(items, cfg.rollout.n, train, drawn)
                    baselines = self.generate(items, 1, greedy, drawn) if remax else []
                drawn += len(items)
                with timer("reward"):
                    reward_stats = self.score(drawn_now, step)
                    if remax:  # the baseline: each prompt's greedy answer's score
                        self.score(baselines, step)
                        baseline = {b.group: b.score for b in baselines}
                        for s in drawn_now:
                            s.reward_baseline = baseline[s.group]
                if round_index == 0:
                    metrics.update(rollout_metrics(drawn_now, response_limit(cfg)))
                    metrics.update(reward_stats)
                    metrics.update(multi_turn_metrics(drawn_now))
                    if self.agent_stats is not None:
                        metrics.update(self.agent_stats.metrics())
                samples += drawn_now
                if dyn.enabled:
                    informative += len(informative_groups(drawn_now, dyn.metric))
                    if informative >= cfg.data.train_batch_size:
                        break
        if dyn.enabled:
            metrics["dapo/gen_batches"] = float(round_index + 1)
        return samples, metrics

    def evaluate(self, data: Sequence[PromptItem], step: int) -> dict[str, float]:
        """Held-out accuracy: greedy (``rollout.val_temperature``) answers to ``data``, scored."""
        start = time.perf_counter()
        with awake(self.engine):
            samples = self.generate(list(data), self.cfg.rollout.val_n, self.sampling(step, False))
        self.score(samples, step)
        metrics = rollout_metrics(samples, response_limit(self.cfg), prefix="val/")
        metrics.update(multi_turn_metrics(samples, prefix="val/"))
        if self.agent_stats is not None:
            metrics.update(self.agent_stats.metrics(prefix="val/"))
        metrics["val/num_prompts"] = float(len(data))
        metrics["timing/val"] = time.perf_counter() - start
        return metrics

    def close(self) -> None:
        """Free the reward workers, the agent loop's tools, the agents' endpoint and the
        engine."""
        self.rewards.close()
        if self.agent is not None:
            self.agent.close()
        if self.agents is not None:
            self.agents.close()
        self.engine.close()


def _gathered(local: list[Sample], replica: ReplicaInfo) -> list[Sample]:
    """Every replica leader's ``local`` samples, on every rank, ordered by prompt."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return local
    gathered: list[list[Sample] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local if replica.is_leader else [])
    return sorted((s for part in gathered for s in part or []), key=lambda s: s.group)


def _gathered_with_stats(
    local: list[Sample], stats: AgentStats, replica: ReplicaInfo
) -> tuple[list[Sample], AgentStats]:
    """``_gathered``, and the replicas' agent counts summed (the same on every rank)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return local, stats
    parts: list[tuple[list[Sample], AgentStats] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (local, stats) if replica.is_leader else ([], AgentStats()))
    total = AgentStats()
    for _, part_stats in parts:
        total.add(part_stats)
    samples = sorted((s for part, _ in parts for s in part), key=lambda s: s.group)
    return samples, total


def _needs_rule_reward(sample: Sample) -> bool:
    """Whether the rule reward scores ``sample``: not an agent's, or the last segment of an
    agent's trajectory whose agent returned no reward."""
    record = sample.trajectory
    if record is None or record.agent is None:
        return True
    agent = record.agent
    return agent.reward is None and agent.segment == agent.segments - 1


def share_agent_scores(samples: list[Sample]) -> None:
    """Every agent segment's score: its agent's reward, else its trajectory's last segment's."""
    scored = {
        s.trajectory.agent.session: s
        for s in samples
        if s.trajectory is not None and s.trajectory.agent is not None and _needs_rule_reward(s)
    }
    for sample in samples:
        agent = sample.trajectory.agent if sample.trajectory is not None else None
        if agent is None:
            continue
        if agent.reward is not None:
            sample.score = agent.reward
        elif agent.session in scored and scored[agent.session] is not sample:
            last = scored[agent.session]
            sample.score, sample.extras = last.score, dict(last.extras)


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
    if not mine:  # (batch_decode of no sequences is not an empty list)
        my_texts = []
    elif texts is None:
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
        routing=train and cfg.model.moe_routing_replay == "r3",  # R3 replays the engine's experts
    )
