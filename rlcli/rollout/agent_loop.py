"""Multi-turn rollouts (``rollout.multi_turn.enable``): trajectories advance turn by turn,
token-in/token-out.

Per turn, on each rollout replica, for the trajectories still running:

1. ONE ``engine.generate_requests``, each request a trajectory's exact token ids so far (never
   decoded and re-encoded). Every rank of the replica makes the same call (the first turn's even
   without trajectories), as one engine needs.
2. The replica's leader parses each new turn for tool calls, runs the calls of all trajectories
   together (``ToolRunner``: concurrently, a timeout per call) and, with an environment, asks it
   to answer the turns without calls; then it sends the turn (completions and answers) to the
   replica's other ranks, so that a tool answering differently twice (timing, randomness) cannot
   make the ranks of one engine send it different requests.
3. Each answer, rendered alone with the chat template (``MessageRenderer``), is appended with loss
   mask 0 and log-prob 0. A trajectory ends when a turn has no tool call (without an environment)
   or its environment is done, or when a budget runs out: ``max_assistant_turns``, or
   ``max_response_tokens`` (generated and appended tokens; an answer that would leave no room to
   generate is not appended).

Sampling is reproducible: every turn of every trajectory has its own seed (``turn_seed``), from
the step's seed, the replica, the trajectory's number in the step and the turn.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from parallel import cpu_compat
from rlcli.data import PromptItem
from rlcli.rollout.base import (
    Completion,
    GenerationRequest,
    ReplicaInfo,
    RolloutEngine,
    SamplingConfig,
    current_replica,
)
from rlcli.rollout.batch import Sample
from rlcli.rollout.trajectory import BudgetCut, TrajectoryRecord
from rlcli.tools.multi_turn import MultiTurnComponents, build_multi_turn
from rlcli.tools.runner import ToolCallOutcome, tool_metrics
from rlcli.tools.tool_config import TrajectoryTools

if TYPE_CHECKING:
    from rlcli.config.agentic import MultiTurnConfig


def turn_seed(step_seed: int, replica: int, trajectory: int, turn: int) -> int:
    """The sampling seed of ``turn`` of ``trajectory`` (its number in the step) on ``replica``."""
    key = f"{step_seed}:{replica}:{trajectory}:{turn}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:4], "big") >> 1


@dataclass
class TurnAnswer:
    """What follows one trajectory's turn, decided by the replica's leader."""

    completion: Completion
    text: str  # the turn decoded (special tokens removed)
    outcomes: list[ToolCallOutcome] = field(default_factory=list)  # its tool calls, run
    messages: list[dict[str, Any]] = field(default_factory=list)  # tool / user messages to add
    ids: list[int] = field(default_factory=list)  # their token ids (and the next turn's header)
    ends: bool = False  # the trajectory ends after this turn
    cut_by: BudgetCut | None = None
    environment_reward: float | None = None


@dataclass
class Trajectory:
    """One trajectory in the making; ``tools`` and ``environment_state`` exist on the leader."""

    number: int  # group * n + sample: its seeds
    group: int
    item: PromptItem
    tools: TrajectoryTools | None
    environment_state: Any
    messages: list[dict[str, Any]]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    turns: int = 0
    tool_calls: list[ToolCallOutcome] = field(default_factory=list)
    environment_reward: float | None = None
    cut_by: BudgetCut | None = None
    last_finish: str = "stop"
    done: bool = False

    def apply(self, answer: TurnAnswer) -> None:
        completion = answer.completion
        self.response_ids += completion.token_ids
        self.loss_mask += [1] * len(completion.token_ids)
        self.log_probs += completion.logprobs or [0.0] * len(completion.token_ids)
        self.messages.append({"role": "assistant", "content": answer.text})
        self.turns += 1
        self.last_finish = completion.finish_reason
        self.tool_calls += answer.outcomes
        if answer.environment_reward is not None:
            self.environment_reward = answer.environment_reward
        self.cut_by, self.done = answer.cut_by, answer.ends
        if not answer.ends:
            self.response_ids += answer.ids
            self.loss_mask += [0] * len(answer.ids)
            self.log_probs += [0.0] * len(answer.ids)
            self.messages += answer.messages

    def sample(self, tokenizer: Any) -> Sample:
        generated = [t for t, m in zip(self.response_ids, self.loss_mask, strict=True) if m]
        record = TrajectoryRecord(
            messages=self.messages,
            solution_str=tokenizer.decode(generated, skip_special_tokens=True),
            assistant_turns=self.turns,
            tool_calls=self.tool_calls,
            tool_rewards=[c.reward for c in self.tool_calls if c.reward is not None],
            environment_reward=self.environment_reward,
            cut_by=self.cut_by,
        )
        cut = self.cut_by is not None or self.last_finish == "length"
        return Sample(
            group=self.group,
            prompt_ids=list(self.item.prompt_token_ids),
            response_ids=self.response_ids,
            engine_log_probs=self.log_probs,
            finish_reason="length" if cut else "stop",
            item=self.item,
            loss_mask=self.loss_mask,
            trajectory=record,
        )


class AgentLoop:
    """Runs a replica's multi-turn trajectories; built once per run (``build_agent_loop``).

    ``replica_group`` (with ``leader_rank``, a global rank) joins the ranks of this rank's
    rollout replica when it has more than one; None otherwise."""

    def __init__(
        self,
        components: MultiTurnComponents,
        tokenizer: Any,
        replica_group: Any = None,
        leader_rank: int = 0,
    ) -> None:
        self.components = components
        self.tokenizer = tokenizer
        self.replica_group = replica_group
        self.leader_rank = leader_rank
        self.end_of_turn_id = components.renderer.end_of_turn_id

    @property
    def is_leader(self) -> bool:
        return self.replica_group is None or dist.get_rank() == self.leader_rank

    def check_items(self, items: Iterable[PromptItem]) -> None:
        """``UserError`` naming the row for ``extra_info.tools_kwargs`` the tools cannot take."""
        if self.components.tools is not None:
            for item in items:
                self._tools_of(item)

    def run(
        self,
        engine: RolloutEngine,
        prompts: Sequence[tuple[int, PromptItem]],
        n: int,
        sampling: SamplingConfig,
        replica_index: int,
    ) -> list[Sample]:
        """``n`` trajectories for each ``(group, item)`` of this replica's prompts, in order."""
        trajectories = [
            self._start(group * n + k, group, item) for group, item in prompts for k in range(n)
        ]
        while True:
            live = [t for t in trajectories if not t.done]
            requests = [self._request(t, sampling, replica_index) for t in live]
            if not requests and any(t.turns for t in trajectories):
                break  # (the first turn steps the engine even without trajectories)
            with cpu_compat.suspended():  # the engine never calls megatron-core
                completions = [c[0] for c in engine.generate_requests(requests)]
            if not live:
                break
            answers = self._answer(live, completions) if self.is_leader else None
            for trajectory, answer in zip(live, self._share(answers), strict=True):
                trajectory.apply(answer)
        for trajectory in trajectories:
            self._release(trajectory)
        return [t.sample(self.tokenizer) for t in trajectories]

    def close(self) -> None:
        self.components.close()

    def _start(self, number: int, group: int, item: PromptItem) -> Trajectory:
        parts = self.components
        tools = state = None
        if self.is_leader:
            tools = self._tools_of(item) if parts.tools is not None else None
            if parts.environment is not None:
                state = parts.environment.start(item.extra_info.get("interaction_kwargs") or {})
        return Trajectory(number, group, item, tools, state, copy.deepcopy(item.prompt_messages))

    def _tools_of(self, item: PromptItem) -> TrajectoryTools:
        where = item.origin or f"prompt {item.index}"
        return self.components.tools.for_trajectory(item.extra_info.get("tools_kwargs"), where)

    def _request(
        self, t: Trajectory, sampling: SamplingConfig, replica_index: int
    ) -> GenerationRequest:
        limit = self.components.budget.generation_limit(len(t.response_ids), sampling.max_tokens)
        stops = set(sampling.stop_token_ids)
        if self.end_of_turn_id is not None:
            stops.add(self.end_of_turn_id)
        params = dataclasses.replace(sampling, max_tokens=limit, stop_token_ids=sorted(stops))
        seed = None
        if sampling.seed is not None:
            seed = turn_seed(sampling.seed, replica_index, t.number, t.turns)
        return GenerationRequest(list(t.item.prompt_token_ids) + t.response_ids, params, 1, seed)

    def _answer(self, live: list[Trajectory], completions: list[Completion]) -> list[TurnAnswer]:
        """The leader's decisions for the turn just generated: tool calls run, environment
        answers, budget cuts."""
        parts = self.components
        answers, calling, asking = [], [], []
        for t, completion in zip(live, completions, strict=True):
            answer = TurnAnswer(completion, self._decode(completion.token_ids))
            answers.append(answer)
            calls = parts.parse_tool_calls(answer.text).calls if parts.tools else []
            turns, tokens = t.turns + 1, len(t.response_ids) + len(completion.token_ids)
            if not calls and parts.environment is None:
                answer.ends = True  # the model answered
            elif not parts.budget.may_continue(turns, tokens):
                answer.ends = True
                cut = turns >= parts.budget.max_assistant_turns
                answer.cut_by = "max_assistant_turns" if cut else "max_response_tokens"
            elif calls:
                calling.append((t, answer, calls))
            else:
                asking.append((t, answer))
        if calling:
            outcomes = parts.runner.run_turn([(t.tools, calls) for t, _, calls in calling])
            for (_, answer, _), turn_outcomes in zip(calling, outcomes, strict=True):
                answer.outcomes = turn_outcomes
                answer.messages = parts.tool_messages(turn_outcomes)
        for t, answer in asking:
            response = parts.environment.respond(t.environment_state, answer.text)
            answer.environment_reward = response.reward
            if response.done:
                answer.ends = True
            else:
                answer.messages = [{"role": "user", "content": response.text}]
        for t, answer in [(t, a) for t, a, _ in calling] + asking:
            if answer.ends:
                continue
            generated = answer.completion.token_ids
            answer.ids = parts.renderer.append_ids(generated, answer.messages)
            used = len(t.response_ids) + len(generated) + len(answer.ids)
            if used >= parts.budget.max_response_tokens:
                answer.ends, answer.cut_by = True, "max_response_tokens"
        return answers

    def _share(self, answers: list[TurnAnswer] | None) -> list[TurnAnswer]:
        """The leader's answers, on every rank of the replica."""
        if self.replica_group is None:
            return answers
        box = [answers]
        dist.broadcast_object_list(box, src=self.leader_rank, group=self.replica_group)
        return box[0]

    def _release(self, t: Trajectory) -> None:
        if t.tools is not None:
            t.tools.release()
        if t.environment_state is not None:
            self.components.environment.release(t.environment_state)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def multi_turn_metrics(samples: Sequence[Sample], prefix: str = "") -> dict[str, float]:
    """A step's ``multi_turn/*`` and ``tool/*`` metrics (``prefix``: ``val/`` for held-out):
    assistant turns and tool calls per trajectory, the shares of trajectories that called a tool
    and that a budget cut, the share of response tokens the model did not generate (tool /
    environment tokens), the calls' error / timeout rates and latencies."""
    records = [s.trajectory for s in samples if s.trajectory is not None]
    if not records:
        return {}
    count = len(records)
    response_tokens = sum(len(s.response_ids) for s in samples)
    generated = sum(sum(s.loss_mask) for s in samples if s.loss_mask is not None)
    cuts = [r.cut_by for r in records]
    metrics = {
        "multi_turn/turns_mean": sum(r.assistant_turns for r in records) / count,
        "multi_turn/turns_max": float(max(r.assistant_turns for r in records)),
        "multi_turn/tool_calls_mean": sum(len(r.tool_calls) for r in records) / count,
        "multi_turn/tool_call_rate": sum(bool(r.tool_calls) for r in records) / count,
        "multi_turn/budget_cut_rate": sum(c is not None for c in cuts) / count,
        "multi_turn/cut_by_turns_rate": cuts.count("max_assistant_turns") / count,
        "multi_turn/cut_by_tokens_rate": cuts.count("max_response_tokens") / count,
        "multi_turn/masked_token_ratio": 1.0 - generated / max(response_tokens, 1),
    }
    rewards = [r.environment_reward for r in records if r.environment_reward is not None]
    if rewards:
        metrics["multi_turn/environment_reward_mean"] = sum(rewards) / len(rewards)
    metrics.update(tool_metrics(call for r in records for call in r.tool_calls))
    return {f"{prefix}{key}": value for key, value in metrics.items()}


def build_agent_loop(
    multi_turn: MultiTurnConfig, tokenizer: Any, tokenizer_key: str, rollout_tp: int
) -> AgentLoop | None:
    """The run's agent loop (None unless ``multi_turn.enable``), built once by the run's builder
    and held by its ``rlcli.rollout.sampling.Sampler``; ``tokenizer_key``: the config key naming the
    tokenizer (for errors). Collective with ``rollout_tp > 1`` (it makes the replicas' process
    groups over the engines' world): every rank calls it at the same point."""
    if not multi_turn.enable:
        return None
    components = build_multi_turn(multi_turn, tokenizer, tokenizer_key)
    group, leader = replica_group(current_replica(rollout_tp))
    return AgentLoop(components, tokenizer, group, leader)


def replica_group(replica: ReplicaInfo) -> tuple[Any, int]:
    """(the process group of this rank's rollout replica, its first rank), or (None, 0) when a
    replica is one rank. Every rank creates every replica's group, in the same order."""
    if replica.size == 1 or not (dist.is_available() and dist.is_initialized()):
        return None, 0
    mine = None
    for index in range(replica.count):
        first = index * replica.size
        group = dist.new_group(list(range(first, first + replica.size)))
        if index == replica.index:
            mine = group
    return mine, replica.first_rank
