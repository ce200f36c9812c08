"""The OpenAI-compatible endpoint in front of a rollout replica's engine.

While rollouts run, each replica's leader serves, on loopback by default:

- ``POST /s/<session>/v1/chat/completions`` and ``/v1/completions``, ``GET .../v1/models``: each
  agent gets its own base URL (``/s/<session>/v1``), so its calls are told apart from the other
  agents' without asking anything of the agent. ``rlcli serve`` also answers on ``/v1/...``.
- A per-run API key (``Authorization: Bearer``); another key gets 401, another model name 404,
  a request the chat template cannot render 400, as the OpenAI API does.

The HTTP side is FastAPI on uvicorn in a thread of its own; the engine stays on the rank's main
thread (vLLM and the replica's other ranks need that): handlers queue their requests, and the
rollout's drive loop (``rlcli.rollout.agents.runner``) takes them in batches (``next_batch``: whatever
arrived, waiting a few milliseconds for the agents still running to send theirs) for ONE
``engine.generate_requests`` each, then answers every handler. Request and response bodies are
the ``openai`` package's own types.

Sampling: during training the run's ``rollout.temperature`` / ``top_p`` / ``top_k`` apply to
every call whatever the agent asks (the trainer's log-probs assume them); a call that asked for
other values is counted (``agent/sampling_overridden``). ``max_tokens`` is capped by
``rollout.max_tokens`` and by what is left of the trajectory's token budget.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import queue
import secrets
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from rlcli.rollout.agent_loop import turn_seed
from rlcli.rollout.agents.capture import CapturedCall
from rlcli.rollout.agents.chat import Conversation, RendererCache
from rlcli.rollout.base import Completion, GenerationRequest, SamplingConfig

_STARTUP_TIMEOUT_S = 30.0


class EndpointError(Exception):
    """An HTTP error answered in the OpenAI API's shape."""

    def __init__(self, status: int, message: str, kind: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.code = status, message, kind, code


@dataclass
class Session:
    """One agent's calls: the conversation state, what was captured, and what went wrong."""

    id: str
    number: int  # the trajectory's number in the step (group * n + k): its sampling seeds
    conversation: Conversation
    budget: int  # tokens the trajectory may still add (prompt growth + sampled)
    calls: list[CapturedCall] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)  # the last conversation + reply
    unknown_model: int = 0
    bad_requests: int = 0
    sampling_overridden: int = 0
    closed: bool = False


@dataclass
class PendingCall:
    request: GenerationRequest
    session: Session | None
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class AgentServer:
    """An OpenAI-compatible HTTP endpoint over one engine replica (module docstring).

    ``tokenizer_key`` names the tokenizer's config key in errors; ``tool_format`` is how the
    model writes tool calls; ``open_routes``: also answer on ``/v1/...`` without a session
    (``rlcli serve``), honouring the request's own sampling."""

    def __init__(
        self,
        tokenizer: Any,
        tokenizer_key: str,
        model_name: str,
        host: str = "127.0.0.1",
        port: int = 0,
        tool_format: str = "hermes",
        api_key: str | None = None,
        open_routes: bool = False,
        max_model_len: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.tool_format = tool_format
        self.api_key = api_key or f"rlcli-{secrets.token_urlsafe(24)}"
        self.open_routes = open_routes
        self.max_model_len = max_model_len
        self.renderers = RendererCache(tokenizer, tokenizer_key)
        self.sampling = SamplingConfig()
        self.replica_index = 0
        self.eos_ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        self._sessions: dict[str, Session] = {}
        self._queue: queue.Queue[PendingCall] = queue.Queue()
        self._socket = socket.create_server((host, port))
        self.host, self.port = self._socket.getsockname()[:2]
        self._server: Any = None
        self._thread: threading.Thread | None = None

    # -- lifetime -------------------------------------------------------------------------------

    def start(self, app: Any) -> AgentServer:
        """Serve the ASGI ``app`` (``rlcli.rollout.agents.routes.start_endpoint`` builds it) on this
        server's socket, on a thread of its own; returns once it accepts connections."""
        import uvicorn

        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [self._socket]},
            name="rlcli-agent-endpoint",
            daemon=True,
        )
        self._thread.start()
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the agent endpoint did not start on {self.url}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.fail_pending("the endpoint is shutting down")
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._socket.close()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def base_url(self, session: Session | None = None) -> str:
        """What an agent passes as the OpenAI client's ``base_url``."""
        return f"{self.url}/s/{session.id}/v1" if session is not None else f"{self.url}/v1"

    # -- sessions -------------------------------------------------------------------------------

    def configure(self, sampling: SamplingConfig, replica_index: int) -> None:
        """The sampling of the calls to come (training or held-out) and this replica's index."""
        self.sampling, self.replica_index = sampling, replica_index

    def open_session(self, number: int, budget: int) -> Session:
        session = Session(uuid.uuid4().hex, number, Conversation(self.renderers), budget)
        self._sessions[session.id] = session
        return session

    def close_session(self, session: Session) -> None:
        session.closed = True
        self._sessions.pop(session.id, None)

    def session(self, session_id: str | None) -> Session | None:
        """The open session of a request's URL; EndpointError 404 for another."""
        if session_id is None:
            if self.open_routes:
                return None
            raise EndpointError(404, "use the base_url your agent was given", "not_found")
        session = self._sessions.get(session_id)
        if session is None or session.closed:
            raise EndpointError(
                404, f"session {session_id} is over (the agent finished or timed out)", "not_found"
            )
        return session

    def check_key(self, authorization: str | None) -> None:
        if authorization != f"Bearer {self.api_key}":
            raise EndpointError(401, "invalid API key", "invalid_request_error", "invalid_api_key")

    def check_model(self, model: str, session: Session | None) -> None:
        if model != self.model_name:
            if session is not None:
                session.unknown_model += 1
            raise EndpointError(
                404,
                f"the model {model!r} does not exist; this endpoint serves {self.model_name!r}",
                "invalid_request_error",
                "model_not_found",
            )

    # -- generation -----------------------------------------------------------------------------

    def request_for(
        self, session: Session | None, prompt_ids: list[int], body: Any
    ) -> GenerationRequest:
        """The engine request of a call: the run's sampling (or the request's, on open routes),
        ``max_tokens`` capped by the run's and the session's budget."""
        base = self.sampling
        asked = body.max_completion_tokens or body.max_tokens
        limit = min(asked or base.max_tokens, base.max_tokens)
        if self.max_model_len is not None:
            room = self.max_model_len - len(prompt_ids)
            if room < 1:
                raise EndpointError(
                    400,
                    f"the prompt is {len(prompt_ids)} tokens, and the engine holds "
                    f"{self.max_model_len} (rollout.max_model_len)",
                    "invalid_request_error",
                    "context_length_exceeded",
                )
            limit = min(limit, room)
        seed = body.seed
        if session is None:
            sampling = dataclasses.replace(
                base,
                temperature=base.temperature if body.temperature is None else body.temperature,
                top_p=base.top_p if body.top_p is None else body.top_p,
                max_tokens=limit,
            )
        else:
            if (body.temperature is not None and body.temperature != base.temperature) or (
                body.top_p is not None and body.top_p != base.top_p
            ):
                session.sampling_overridden += 1
            if session.budget <= 0:
                raise EndpointError(
                    400,
                    "this trajectory used its token budget (rollout.agent_options."
                    "max_response_tokens); end the episode",
                    "invalid_request_error",
                    "context_length_exceeded",
                )
            limit = min(limit, session.budget)
            sampling = dataclasses.replace(base, max_tokens=limit)
            seed = None
            if base.seed is not None:
                seed = turn_seed(base.seed, self.replica_index, session.number, len(session.calls))
        stops = sorted({*sampling.stop_token_ids, *self.eos_ids, *self._end_of_turn()})
        sampling = dataclasses.replace(sampling, stop_token_ids=stops)
        return GenerationRequest(prompt_ids, sampling, max(1, body.n or 1), seed)

    def _end_of_turn(self) -> list[int]:
        end = self.renderers.get(None).end_of_turn_id if self.tokenizer.chat_template else None
        return [end] if end is not None else []

    async def generate(
        self, request: GenerationRequest, session: Session | None
    ) -> list[Completion]:
        """Queue ``request`` for the drive loop and wait for its completions."""
        pending = PendingCall(request, session)
        self._queue.put(pending)
        return await asyncio.wrap_future(pending.future)

    def capture(self, session: Session | None, call: CapturedCall) -> None:
        """Record a returned completion in its session (not once the session is over: its
        samples may be being made)."""
        if session is not None and not session.closed:
            session.calls.append(call)
            session.budget -= len(call.completion_ids)
            if len(session.calls) > 1:  # the prompt's growth since the previous call counts too
                previous = session.calls[-2]
                grown = (
                    len(call.prompt_ids) - len(previous.prompt_ids) - len(previous.completion_ids)
                )
                session.budget -= max(grown, 0)

    def next_batch(
        self, running: int, poll_s: float = 0.05, linger_s: float = 0.01
    ) -> list[PendingCall]:
        """The calls waiting now (after up to ``poll_s`` for a first one), lingering ``linger_s``
        after each arrival while fewer than ``running`` (the agents still running) wait. Calls
        of sessions that closed meanwhile are answered 404 and left out."""
        try:
            batch = [self._queue.get(timeout=poll_s)]
        except queue.Empty:
            return []
        while len(batch) < running:
            try:
                batch.append(self._queue.get(timeout=linger_s))
            except queue.Empty:
                break
        while True:  # whatever else is already there
            try:
                batch.append(self._queue.get_nowait())
            except queue.Empty:
                break
        live = []
        for pending in batch:
            if pending.session is not None and pending.session.closed:
                pending.future.set_exception(
                    EndpointError(404, "the agent's session is over", "not_found")
                )
            else:
                live.append(pending)
        return live

    def fail_pending(self, message: str) -> None:
        """Answer every queued call with an error (the rollout is over)."""
        while True:
            try:
                pending = self._queue.get_nowait()
            except queue.Empty:
                return
            pending.future.set_exception(EndpointError(503, message, "server_error"))
