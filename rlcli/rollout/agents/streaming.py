"""``stream=true``: a finished response sent as the server-sent events the OpenAI API streams.

The engines answer a request whole (the drive loop batches every waiting call into one engine
call), so a stream carries each choice as one content chunk (role, text, tool calls, log-probs)
followed by a chunk with its finish reason, then the usage chunk when the request asks for it
(``stream_options.include_usage``), then ``data: [DONE]``: what an OpenAI client reads from a
stream, with the same tokens captured for training as without streaming.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from fastapi.responses import StreamingResponse
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.chat.chat_completion_chunk import (
    Choice,
    ChoiceDelta,
    ChoiceDeltaToolCall,
    ChoiceDeltaToolCallFunction,
    ChoiceLogprobs,
)
from openai.types.completion import Completion as TextCompletion


def _event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body)}\n\n"


def _chat_events(completion: ChatCompletion, include_usage: bool) -> Iterator[str]:
    def chunk(choices: list[Choice], usage: Any = None) -> str:
        return _event(
            ChatCompletionChunk(
                id=completion.id,
                choices=choices,
                created=completion.created,
                model=completion.model,
                object="chat.completion.chunk",
                usage=usage,
            ).model_dump(mode="json", exclude_none=True)
        )

    for choice in completion.choices:
        message = choice.message
        calls = [
            ChoiceDeltaToolCall(
                index=i,
                id=call.id,
                type="function",
                function=ChoiceDeltaToolCallFunction(
                    name=call.function.name, arguments=call.function.arguments
                ),
            )
            for i, call in enumerate(message.tool_calls or [])
        ]
        delta = ChoiceDelta(role="assistant", content=message.content, tool_calls=calls or None)
        logprobs = ChoiceLogprobs(content=choice.logprobs.content) if choice.logprobs else None
        yield chunk([Choice(index=choice.index, delta=delta, logprobs=logprobs)])
        end = Choice(index=choice.index, delta=ChoiceDelta(), finish_reason=choice.finish_reason)
        yield chunk([end])
    if include_usage:
        yield chunk([], completion.usage)
    yield "data: [DONE]\n\n"


def _text_events(completion: TextCompletion, include_usage: bool) -> Iterator[str]:
    body = completion.model_dump(mode="json", exclude={"choices", "usage"}, exclude_none=True)
    for choice in completion.choices:
        text = choice.model_dump(mode="json")
        yield _event({**body, "choices": [{**text, "finish_reason": None}]})
        end = {"index": choice.index, "text": "", "finish_reason": choice.finish_reason}
        yield _event({**body, "choices": [{**end, "logprobs": None}]})
    if include_usage and completion.usage is not None:
        yield _event({**body, "choices": [], "usage": completion.usage.model_dump(mode="json")})
    yield "data: [DONE]\n\n"


def _include_usage(stream_options: dict[str, Any] | None) -> bool:
    return bool((stream_options or {}).get("include_usage"))


def stream_chat(completion: ChatCompletion, stream_options: dict[str, Any] | None) -> Any:
    events = _chat_events(completion, _include_usage(stream_options))
    return StreamingResponse(events, media_type="text/event-stream")


def stream_text(completion: TextCompletion, stream_options: dict[str, Any] | None) -> Any:
    events = _text_events(completion, _include_usage(stream_options))
    return StreamingResponse(events, media_type="text/event-stream")
