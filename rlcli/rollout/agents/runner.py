"""Rollouts by agents written against the OpenAI API (``rollout.agent``).

Per rollout call, on each replica's leader: one session per sample on the replica's endpoint
(``rlcli.rollout.agents.server``), the user's agent function called once per session on a thread of
its own (``agent(base_url=..., api_key=..., model=..., row=..., **rollout.agent_options.kwargs)``,
sync or async, ``concurrency`` at once, ``timeout_s`` each), and meanwhile the rank's main thread
drives the engine: the calls the agents made, in batches, one ``generate_requests`` a batch
(``drive``). With ``rollout.tp > 1`` the leader sends each batch to the replica's other ranks
first, which make the same engine call (the engine is one model over all of them).

When every agent has returned, each session's captured calls become samples
(``rlcli.rollout.agents.capture``): one per segment, each carrying the trajectory's reward (what the
agent returned, else the run's reward function's score of the trajectory). An agent that raises,
times out or returns something else than a number or None has failed: counted, and its samples
dropped or scored 0 (``on_failure``); more than ``max_failure_rate`` of a step's agents failing
stops the run with the first failure's error.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from parallel import cpu_compat
from rlcli.config.agentic import AgentOptions
from rlcli.config.schema import RolloutConfig
from rlcli.data import PromptItem
from rlcli.errors import UserError
from rlcli.plugins import load_user_object
from rlcli.rollout.agents.capture import join_calls
from rlcli.rollout.agents.server import AgentServer, EndpointError, Session
from rlcli.rollout.agents.stats import AgentStats
from rlcli.rollout.base import RolloutEngine, SamplingConfig, current_replica
from rlcli.rollout.batch import Sample
from rlcli.rollout.trajectory import AgentRecord, TrajectoryRecord

AGENT_ARGUMENTS = "base_url, api_key, model, row"


def load_agent(spec: str, key: str = "rollout.agent") -> Callable[..., Any]:
    """The function ``module:function`` / ``path/file.py:function`` names; ``UserError`` naming
    ``key`` when it does not import or is not callable."""
    try:
        agent, _ = load_user_object(spec, "agent", "function")
    except UserError as error:
        raise UserError(f"{key}: {error}") from None
    if not callable(agent):
        raise UserError(
            f"{key}={spec!r} is not callable: name a function taking {AGENT_ARGUMENTS} "
            "(docs/agentic.md)"
        )
    return agent


@dataclass
class _Outcome:
    reward: float | None = None
    failure: str | None = None  # error | timeout | bad_return
    error: str | None = None
    seconds: float = 0.0


class AgentRollout:
    """Runs a replica's agents; built once per run (``build_agent_rollout``). ``server`` exists
    on the replica's leader only; ``replica_group`` / ``leader_rank`` join a replica of more
    than one rank (None / 0 otherwise)."""

    def __init__(
        self,
        agent: Callable[..., Any],
        options: AgentOptions,
        tokenizer: Any,
        server: AgentServer | None,
        replica_group: Any = None,
        leader_rank: int = 0,
    ) -> None:
        self.agent = agent
        self.options = options
        self.tokenizer = tokenizer
        self.server = server
        self.replica_group = replica_group
        self.leader_rank = leader_rank
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None

    def run(
        self,
        engine: RolloutEngine,
        prompts: Sequence[tuple[int, PromptItem]],
        n: int,
        sampling: SamplingConfig,
        replica_index: int,
    ) -> tuple[list[Sample], AgentStats]:
        """``n`` agent trajectories for each ``(group, item)`` of this replica's prompts: their
        samples and counts on the leader, ``([], AgentStats())`` on the replica's other ranks."""
        if self.server is None:
            self._follow(engine)
            return [], AgentStats()
        server = self.server
        server.configure(sampling, replica_index)
        budget = self.options.max_response_tokens
        started = [
            (server.open_session(group * n + k, budget), group, item)
            for group, item in prompts
            for k in range(n)
        ]
        loop = self._agent_loop()
        semaphore = asyncio.Semaphore(self.options.concurrency)
        futures = [
            asyncio.run_coroutine_threadsafe(self._one(session, item, semaphore), loop)
            for session, _, item in started
        ]
        try:
            self._drive(engine, futures)
        finally:
            for session, _, _ in started:
                server.close_session(session)
            server.fail_pending("the rollout is over")
        outcomes = [future.result() for future in futures]
        return self._samples(started, outcomes)

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)

    # -- the engine side (main thread) ----------------------------------------------------------

    def _drive(self, engine: RolloutEngine, futures: list[concurrent.futures.Future]) -> None:
        """Answer the agents' calls in batches until every agent returned."""
        batches = 0
        while True:
            running = sum(not f.done() for f in futures)
            batch = self.server.next_batch(running)
            if not batch:
                if running == 0:
                    break
                continue
            requests = [pending.request for pending in batch]
            self._send(requests)
            try:
                with cpu_compat.suspended():  # the engine never calls megatron-core
                    results = engine.generate_requests(requests)
            except BaseException as error:
                for pending in batch:
                    pending.future.set_exception(EndpointError(500, str(error), "server_error"))
                raise
            for pending, completions in zip(batch, results, strict=True):
                pending.future.set_result(completions)
            batches += 1
        if batches == 0:  # the replica's ranks (and vLLM's groups) step together once
            self._send([])
            with cpu_compat.suspended():
                engine.generate_requests([])
        self._send(None)

    def _send(self, requests: list | None) -> None:
        if self.replica_group is not None:
            dist.broadcast_object_list([requests], src=self.leader_rank, group=self.replica_group)

    def _follow(self, engine: RolloutEngine) -> None:
        """A replica's other rank: the leader's engine calls, until it says the rollout is over."""
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=self.leader_rank, group=self.replica_group)
            if box[0] is None:
                return
            with cpu_compat.suspended():
                engine.generate_requests(box[0])

    # -- the agents (their own event loop thread) -----------------------------------------------

    def _agent_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            self._loop_thread = threading.Thread(
                target=self._loop.run_forever, name="rlcli-agents", daemon=True
            )
            self._loop_thread.start()
        return self._loop

    async def _one(
        self, session: Session, item: PromptItem, semaphore: asyncio.Semaphore
    ) -> _Outcome:
        outcome = _Outcome()
        async with semaphore:
            start = time.perf_counter()
            try:
                value = await asyncio.wait_for(self._call(session, item), self.options.timeout_s)
                if value is None or (
                    isinstance(value, int | float) and not isinstance(value, bool)
                ):
                    outcome.reward = None if value is None else float(value)
                else:
                    outcome.failure = "bad_return"
                    outcome.error = (
                        f"the agent returned {type(value).__name__} {value!r:.80}; return a "
                        "number (the reward) or None (the run's reward function scores it)"
                    )
            except TimeoutError:
                outcome.failure = "timeout"
                outcome.error = (
                    f"the agent ran past rollout.agent_options.timeout_s={self.options.timeout_s}"
                )
            except Exception as error:  # the user's code: counted, never fatal by itself
                outcome.failure = "error"
                outcome.error = f"{type(error).__name__}: {error}"
            finally:
                session.closed = True  # later calls of a timed-out agent get 404
            outcome.seconds = time.perf_counter() - start
        return outcome

    async def _call(self, session: Session, item: PromptItem) -> Any:
        kwargs = {
            "base_url": self.server.base_url(session),
            "api_key": self.server.api_key,
            "model": self.server.model_name,
            "row": agent_row(item),
            **self.options.kwargs,
        }
        if inspect.iscoroutinefunction(self.agent):
            return await self.agent(**kwargs)
        done: concurrent.futures.Future = concurrent.futures.Future()

        def call() -> None:  # its own thread: a sync agent that never returns holds only that
            try:
                result = self.agent(**kwargs)
                if inspect.isawaitable(result):
                    result = asyncio.run(result)
                outcome = (done.set_result, result)
            except BaseException as error:
                outcome = (done.set_exception, error)
            if not done.cancelled():  # cancelled: the agent ran past its timeout
                outcome[0](outcome[1])

        threading.Thread(target=call, name="rlcli-agent", daemon=True).start()
        return await asyncio.wrap_future(done)

    # -- samples --------------------------------------------------------------------------------

    def _samples(
        self, started: list[tuple[Session, int, PromptItem]], outcomes: list[_Outcome]
    ) -> tuple[list[Sample], AgentStats]:
        stats = AgentStats(agents=len(started))
        samples: list[Sample] = []
        for (session, group, item), outcome in zip(started, outcomes, strict=True):
            stats.calls += len(session.calls)
            stats.seconds += outcome.seconds
            stats.unknown_model += session.unknown_model
            stats.bad_requests += session.bad_requests
            stats.sampling_overridden += session.sampling_overridden
            stats.reused_prompts += session.conversation.reused
            stats.rendered_prompts += session.conversation.rendered
            segments = join_calls(session.calls)
            if outcome.failure is not None:
                stats.failed += 1
                stats.errors += outcome.failure == "error"
                stats.timeouts += outcome.failure == "timeout"
                stats.bad_returns += outcome.failure == "bad_return"
                stats.first_error = stats.first_error or outcome.error
                if self.options.on_failure == "drop":
                    stats.dropped_samples += len(segments)
                    continue
            if not segments:
                stats.no_calls += outcome.failure is None
                continue
            stats.splits += len(segments) - 1
            stats.split_trajectories += len(segments) > 1
            reward = 0.0 if outcome.failure is not None else outcome.reward
            generated = [t for call in session.calls for t in call.completion_ids]
            solution = self.tokenizer.decode(generated, skip_special_tokens=True)
            messages = session.messages or list(item.prompt_messages or [])
            for index, segment in enumerate(segments):
                record = TrajectoryRecord(
                    messages=messages,
                    solution_str=solution,
                    assistant_turns=segment.calls,
                    agent=AgentRecord(session.id, reward, index, len(segments), len(session.calls)),
                )
                samples.append(
                    Sample(
                        group=group,
                        prompt_ids=segment.prompt_ids,
                        response_ids=segment.response_ids,
                        engine_log_probs=segment.log_probs,
                        finish_reason="length" if segment.finish_reason == "length" else "stop",
                        item=item,
                        loss_mask=segment.loss_mask,
                        trajectory=record,
                    )
                )
        stats.samples = len(samples)
        return samples, stats


def agent_row(item: PromptItem) -> dict[str, Any]:
    """The data row as the agent gets it."""
    return {
        "prompt": item.prompt_messages or item.prompt_text,
        "data_source": item.data_source,
        "ground_truth": item.ground_truth,
        "extra_info": item.extra_info,
        "index": item.index,
    }


def build_agent_rollout(
    rollout: RolloutConfig, tokenizer: Any, tokenizer_key: str, max_model_len: int | None
) -> AgentRollout | None:
    """The run's agent rollout (None without ``rollout.agent``): the agent loaded, and on each
    replica's leader its endpoint started. Collective with ``rollout.tp > 1`` (it makes the
    replicas' process groups): every rank that samples calls it at the same point."""
    if rollout.agent is None:
        return None
    from rlcli.rollout.agent_loop import replica_group

    agent = load_agent(rollout.agent)
    options = rollout.agent_options
    replica = current_replica(rollout.tp)
    group, leader = replica_group(replica)
    server = None
    if replica.is_leader:
        from rlcli.rollout.agents.routes import start_endpoint

        server = AgentServer(
            tokenizer,
            tokenizer_key,
            options.model_name,
            host=options.host,
            tool_format=rollout.multi_turn.format,
            max_model_len=max_model_len,
        )
        start_endpoint(server)
    return AgentRollout(agent, options, tokenizer, server, group, leader)
