"""The endpoint's HTTP routes (FastAPI): request bodies in, the ``openai`` package's response
types out. What a route does with a call is ``AgentServer``'s; see ``rlcli.rollout.agents.server``."""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Header, Request
from fastapi.responses import JSONResponse
from openai.types import Model
from openai.types.chat import ChatCompletion, ChatCompletionMessage
from openai.types.chat.chat_completion import Choice, ChoiceLogprobs
from openai.types.chat.chat_completion_token_logprob import ChatCompletionTokenLogprob
from openai.types.completion import Completion as TextCompletion
from openai.types.completion_choice import CompletionChoice, Logprobs
from openai.types.completion_usage import CompletionUsage
from pydantic import BaseModel, ConfigDict

from rlcli.rollout.agents.capture import CapturedCall
from rlcli.rollout.agents.chat import BadRequest, Conversation, reply_message
from rlcli.rollout.agents.server import AgentServer, EndpointError, Session
from rlcli.rollout.agents.streaming import stream_chat, stream_text

if TYPE_CHECKING:
    from rlcli.rollout.base import Completion


class _Sampled(BaseModel):
    """The request fields that shape sampling (others are accepted and ignored)."""

    model_config = ConfigDict(extra="allow")
    model: str
    n: int | None = 1
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None


class ChatRequest(_Sampled):
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class CompletionRequest(_Sampled):
    prompt: str | list[int] | list[str]
    logprobs: int | None = None


def _stops(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


def cut_at_stop(tokenizer: Any, completion: Completion, stops: list[str]) -> tuple[int, str]:
    """How many of the completion's tokens to keep and its text: up to the first token whose
    text reaches one of ``stops`` (the tokens after it were sampled later, so dropping them
    keeps what remains exactly as sampled); the text ends before the stop string."""
    ids = completion.token_ids
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if not stops or not any(s in text for s in stops):
        return len(ids), text
    for keep in range(1, len(ids) + 1):
        prefix = tokenizer.decode(ids[:keep], skip_special_tokens=True)
        hits = [prefix.index(s) for s in stops if s in prefix]
        if hits:
            return keep, prefix[: min(hits)]
    return len(ids), text


def _token_logprobs(tokenizer: Any, ids: list[int], logprobs: list[float]) -> ChoiceLogprobs:
    return ChoiceLogprobs(
        content=[
            ChatCompletionTokenLogprob(
                token=tokenizer.convert_ids_to_tokens(token),
                logprob=value,
                bytes=list(tokenizer.decode([token]).encode()),
                top_logprobs=[],
            )
            for token, value in zip(ids, logprobs, strict=True)
        ]
    )


def _usage(prompt_ids: list[int], sampled: int) -> CompletionUsage:
    return CompletionUsage(
        prompt_tokens=len(prompt_ids),
        completion_tokens=sampled,
        total_tokens=len(prompt_ids) + sampled,
    )


def start_endpoint(server: AgentServer) -> AgentServer:
    """``server`` answering the routes below; returns once it accepts connections."""
    return server.start(build_app(server))


def build_app(server: AgentServer) -> FastAPI:
    app = FastAPI(title="rlcli agent endpoint", docs_url=None, redoc_url=None)
    tokenizer = server.tokenizer

    @app.exception_handler(EndpointError)
    async def _endpoint_error(_: Request, error: EndpointError) -> JSONResponse:
        body = {"message": error.message, "type": error.kind, "param": None, "code": error.code}
        return JSONResponse({"error": body}, status_code=error.status)

    def _open(session_id: str | None, authorization: str | None, model: str | None) -> Session:
        server.check_key(authorization)
        session = server.session(session_id)
        if model is not None:
            server.check_model(model, session)
        return session

    async def _sample(
        session: Session | None, prompt_ids: list[int], body: _Sampled
    ) -> list[tuple[list[int], list[float], str, str]]:
        """Generate for one request; per choice the kept tokens, their log-probs, the finish
        reason and the text, each one captured for training."""
        completions = await server.generate(server.request_for(session, prompt_ids, body), session)
        kept = []
        for completion in completions:
            keep, text = cut_at_stop(tokenizer, completion, _stops(body.stop))
            ids, logprobs = completion.token_ids[:keep], completion.logprobs[:keep]
            finish = "stop" if keep < len(completion.token_ids) else completion.finish_reason
            server.capture(session, CapturedCall(list(prompt_ids), ids, logprobs, finish))
            kept.append((ids, logprobs, finish, text))
        return kept

    async def chat(body: ChatRequest, session_id: str | None, authorization: str | None) -> Any:
        session = _open(session_id, authorization, body.model)
        conversation = session.conversation if session is not None else None
        if conversation is None:
            conversation = Conversation(server.renderers)
        try:
            if body.top_logprobs:
                raise BadRequest(
                    "top_logprobs is not served: the engines return the sampled token's "
                    "log-prob only (logprobs=true gives it per token)"
                )
            prompt_ids, wanted = conversation.prompt_ids(body.messages, body.tools)
        except BadRequest as error:
            if session is not None:
                session.bad_requests += 1
            raise EndpointError(400, str(error), "invalid_request_error") from None
        choices, sampled = [], 0
        for index, (ids, logprobs, finish, text) in enumerate(
            await _sample(session, prompt_ids, body)
        ):
            reply = reply_message(text, finish, bool(body.tools), server.tool_format)
            conversation.record(wanted, prompt_ids, ids, reply)
            if session is not None:
                session.messages = [*body.messages, reply.message]
            sampled += len(ids)
            choices.append(
                Choice(
                    index=index,
                    message=ChatCompletionMessage(**reply.message),
                    finish_reason=reply.finish_reason,
                    logprobs=_token_logprobs(tokenizer, ids, logprobs) if body.logprobs else None,
                )
            )
        response = ChatCompletion(
            id=f"chatcmpl-{uuid.uuid4().hex}",
            choices=choices,
            created=int(time.time()),
            model=server.model_name,
            object="chat.completion",
            usage=_usage(prompt_ids, sampled),
        )
        if body.stream:
            return stream_chat(response, body.stream_options)
        return response.model_dump(mode="json")

    async def complete(
        body: CompletionRequest, session_id: str | None, authorization: str | None
    ) -> Any:
        session = _open(session_id, authorization, body.model)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise EndpointError(400, "send one prompt per request", "invalid_request_error")
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt_ids = list(tokenizer(prompt)["input_ids"])
        else:
            prompt_ids = [int(t) for t in prompt]
        if not prompt_ids:
            raise EndpointError(400, "the prompt is empty", "invalid_request_error")
        choices, sampled = [], 0
        for index, (ids, logprobs, finish, text) in enumerate(
            await _sample(session, prompt_ids, body)
        ):
            sampled += len(ids)
            tokens = tokenizer.convert_ids_to_tokens(ids)
            choices.append(
                CompletionChoice(
                    index=index,
                    text=text,
                    finish_reason=finish,
                    logprobs=Logprobs(tokens=tokens, token_logprobs=logprobs)
                    if body.logprobs is not None
                    else None,
                )
            )
        response = TextCompletion(
            id=f"cmpl-{uuid.uuid4().hex}",
            choices=choices,
            created=int(time.time()),
            model=server.model_name,
            object="text_completion",
            usage=_usage(prompt_ids, sampled),
        )
        if body.stream:
            return stream_text(response, body.stream_options)
        return response.model_dump(mode="json")

    async def models(session_id: str | None, authorization: str | None) -> dict:
        _open(session_id, authorization, None)
        model = Model(id=server.model_name, created=0, object="model", owned_by="rlcli")
        return {"object": "list", "data": [model.model_dump(mode="json")]}

    @app.post("/s/{session_id}/v1/chat/completions", response_model=None)
    async def session_chat(
        session_id: str, body: ChatRequest, authorization: str | None = Header(None)
    ) -> Any:
        return await chat(body, session_id, authorization)

    @app.post("/s/{session_id}/v1/completions", response_model=None)
    async def session_complete(
        session_id: str, body: CompletionRequest, authorization: str | None = Header(None)
    ) -> Any:
        return await complete(body, session_id, authorization)

    @app.get("/s/{session_id}/v1/models")
    async def session_models(session_id: str, authorization: str | None = Header(None)) -> dict:
        return await models(session_id, authorization)

    @app.post("/v1/chat/completions", response_model=None)
    async def open_chat(body: ChatRequest, authorization: str | None = Header(None)) -> Any:
        return await chat(body, None, authorization)

    @app.post("/v1/completions", response_model=None)
    async def open_complete(
        body: CompletionRequest, authorization: str | None = Header(None)
    ) -> Any:
        return await complete(body, None, authorization)

    @app.get("/v1/models")
    async def open_models(authorization: str | None = Header(None)) -> dict:
        return await models(None, authorization)

    return app
