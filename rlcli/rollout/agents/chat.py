"""Chat requests as token ids, and completions as OpenAI assistant messages.

A conversation keeps the token ids of every assistant message it returned. When an agent sends
its history back (the messages it was answered with, that answer, then new messages: tool
results, a user turn), the prompt is those kept ids with only the new messages rendered after
them (``MessageRenderer.append_ids``): the assistant turns the model wrote are never re-rendered
from text, so the prompt extends the previous call token for token and the calls join into one
training sample (``rlcli.rollout.agents.capture``). Any other history is rendered whole with the chat
template; if that does not extend an earlier call, the trajectory splits there.

Tool calls: a completion is parsed with the run's tool-call format (``rollout.multi_turn.
format``, hermes by default) when the request offered ``tools``; well-formed calls become the
message's ``tool_calls``; a completion with a call the parser cannot read is returned as plain
``content`` (as vLLM's server does), so the agent sees what the model wrote.
"""

from __future__ import annotations

import json
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

from rlcli.errors import UserError
from rlcli.tools.parsing import MalformedToolCall, get_tool_call_parser
from rlcli.tools.rendering import MessageRenderer


class BadRequest(ValueError):
    """A request the endpoint cannot answer; its text is the HTTP 400 error message."""


def _text_content(content: Any) -> str:
    """A message's content as text: a string, or the text parts of a list of parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadRequest(f"content parts of type {kind!r} are not supported (text only)")
            texts.append(str(part.get("text", "")))
        return "".join(texts)
    raise BadRequest(f"message content must be a string or a list of parts, not {content!r}")


def _arguments(raw: Any) -> Any:
    """A tool call's arguments as an object (the OpenAI API sends them as a JSON string)."""
    if isinstance(raw, str):
        try:
            return json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError:
            return raw
    return raw


def template_message(message: Any) -> dict[str, Any]:
    """An OpenAI message as chat templates take it: text content, tool calls with their
    arguments as objects; what only identifies a call (ids) or is empty is left out. Two
    messages that render alike compare equal."""
    if not isinstance(message, dict) or "role" not in message:
        raise BadRequest(f"every message needs a 'role': got {message!r}")
    out: dict[str, Any] = {
        "role": message["role"],
        "content": _text_content(message.get("content")),
    }
    if message.get("name"):
        out["name"] = message["name"]
    calls = message.get("tool_calls") or []
    if calls:
        out["tool_calls"] = [
            {
                "type": "function",
                "function": {
                    "name": call.get("function", {}).get("name"),
                    "arguments": _arguments(call.get("function", {}).get("arguments")),
                },
            }
            for call in calls
        ]
    return out


@dataclass
class Reply:
    """One completion as an OpenAI assistant message."""

    message: dict[str, Any]  # role, content, tool_calls (OpenAI format: arguments a JSON string)
    finish_reason: str  # stop | length | tool_calls


def reply_message(text: str, finish_reason: str, tools_offered: bool, tool_format: str) -> Reply:
    """``text`` (a completion, special tokens removed) as an assistant message."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tools_offered:
        parsed = get_tool_call_parser(tool_format)(text)
        good = [c for c in parsed.calls if not isinstance(c, MalformedToolCall)]
        if good and len(good) == len(parsed.calls):
            message["content"] = parsed.content.strip() or None
            message["tool_calls"] = [
                {
                    "id": f"call_{uuid.uuid4().hex[:24]}",
                    "type": "function",
                    "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
                }
                for call in good
            ]
            if finish_reason == "stop":
                finish_reason = "tool_calls"
    return Reply(message, finish_reason)


class RendererCache:
    """One ``MessageRenderer`` per tool list (the tools shape the system prompt), shared by a
    server's conversations; ``tokenizer_key`` names the tokenizer's config key in errors."""

    def __init__(self, tokenizer: Any, tokenizer_key: str) -> None:
        self.tokenizer = tokenizer
        self.tokenizer_key = tokenizer_key
        self._renderers: dict[str, MessageRenderer] = {}
        self._lock = threading.Lock()

    def get(self, tools: list[dict[str, Any]] | None) -> MessageRenderer:
        key = json.dumps(tools or [], sort_keys=True)
        with self._lock:
            if key not in self._renderers:
                try:
                    renderer = MessageRenderer(self.tokenizer, tools, self.tokenizer_key)
                except UserError as error:
                    raise BadRequest(str(error)) from None
                self._renderers[key] = renderer
            return self._renderers[key]


@dataclass
class _Answered:
    """A call answered in a conversation: the history it continued (its messages and the
    reply, as templates take them) and the token ids up to the reply's last sampled token."""

    history: list[dict[str, Any]]
    completion_ids: list[int]
    full_ids: list[int]


@dataclass
class Conversation:
    """One agent session's chat state: how to turn its next message list into token ids."""

    renderers: RendererCache
    answered: list[_Answered] = field(default_factory=list)
    reused: int = 0  # prompts built on kept token ids
    rendered: int = 0  # prompts rendered whole from text

    def prompt_ids(
        self, messages: list[Any], tools: list[dict[str, Any]] | None
    ) -> tuple[list[int], list[dict[str, Any]]]:
        """The prompt's token ids and the messages as templates take them."""
        if not messages:
            raise BadRequest("messages must not be empty")
        wanted = [template_message(m) for m in messages]
        renderer = self.renderers.get(tools)
        best = None
        for turn in self.answered:
            size = len(turn.history)
            if size < len(wanted) and wanted[:size] == turn.history:
                if best is None or size > len(best.history):
                    best = turn
        try:
            if best is not None:
                tail = wanted[len(best.history) :]
                ids = best.full_ids + renderer.append_ids(best.completion_ids, tail)
                self.reused += 1
                return ids, wanted
            self.rendered += 1
            return renderer.prompt_ids(wanted), wanted
        except UserError as error:
            raise BadRequest(str(error)) from None

    def record(
        self,
        wanted: list[dict[str, Any]],
        prompt_ids: list[int],
        completion_ids: list[int],
        reply: Reply,
    ) -> None:
        """Keep a returned reply's token ids for the calls that continue after it."""
        history = wanted + [template_message(reply.message)]
        self.answered.append(_Answered(history, list(completion_ids), prompt_ids + completion_ids))
