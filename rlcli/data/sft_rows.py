"""SFT rows: prompt/response pairs, or whole conversations with tool calls and tool responses.

``{"prompt": str, "response": str}``: the loss is on the response (the trainer appends EOS).

``{"prompt": [...] or str, "images": [...], "response": str}``: a prompt with images (a
vision-language model's; verl's multimodal schema, ``rlcli.data.images``), rendered and processed
by the model's processor; the loss is on the response.

``{"messages": [...]}``: chat messages (``role``, ``content``; a ``tool`` message may carry the
tool's ``name``). The messages before the first assistant message are the prompt; from there on
the loss is on the assistant messages only (their tokens and their end-of-turn token, exactly as
a multi-turn rollout generates them), never on tool or user messages, which the model reads but
does not write. The conversation must end with an assistant message.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from rlcli.data.dataset import parse_messages
from rlcli.data.rows import RowLocation, read_rows
from rlcli.errors import UserError


@dataclass(frozen=True)
class SFTConversation:
    messages: list[dict[str, Any]]
    origin: str  # file and line, for errors
    # the row's own tools (OpenAI function schemas, the row's "tools"), rendered into its system
    # prompt as an agent offering them would; None: the run's (rollout.multi_turn.tool_config)
    tools: list[dict[str, Any]] | None = None

    @property
    def prompt(self) -> list[dict[str, Any]]:
        return self.messages[: self.first_assistant]

    @property
    def first_assistant(self) -> int:
        return next(i for i, m in enumerate(self.messages) if m["role"] == "assistant")


@dataclass(frozen=True)
class SFTImagePrompt:
    """A prompt with images and the response to learn (module docstring)."""

    messages: list[dict[str, Any]]
    images: Any  # the row's ``images`` value, as read (``rlcli.data.images`` loads it)
    response: str
    location: RowLocation


SFTRow = tuple[str, str] | SFTConversation | SFTImagePrompt


def read_sft_rows(path: str) -> list[SFTRow]:
    """The rows of an SFT file: ``(prompt, response)`` pairs and ``SFTConversation``s."""
    rows: list[SFTRow] = []
    for location, row in read_rows(path):
        if "images" in row:
            rows.append(_image_prompt(row, location))
            continue
        if "messages" in row:
            conversation = _conversation(row["messages"], str(location))
            rows.append(replace(conversation, tools=_tools(row.get("tools"), str(location))))
            continue
        for key in ("prompt", "response"):
            if not isinstance(row.get(key), str):
                raise UserError(
                    f"{location}: an SFT row needs string keys 'prompt' and 'response', or "
                    f"'messages' (a conversation); {key!r} is missing"
                )
        rows.append((row["prompt"], row["response"]))
    if not rows:
        raise UserError(f"{path} has no SFT rows")
    return rows


def _image_prompt(row: dict[str, Any], location: RowLocation) -> SFTImagePrompt:
    messages = parse_messages(row.get("prompt"), location, "prompt")
    if not isinstance(row.get("response"), str):
        raise UserError(f"{location}: an SFT row with 'images' needs a string 'response'")
    return SFTImagePrompt(messages, row["images"], row["response"], location)


def _tools(tools: Any, where: str) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise UserError(f"{where}: 'tools' must be a list of OpenAI function schemas (objects)")
    return tools


def _conversation(messages: Any, where: str) -> SFTConversation:
    if not isinstance(messages, list) or not messages:
        raise UserError(f"{where}: 'messages' must be a non-empty list of chat messages")
    for position, message in enumerate(messages):
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or not isinstance(message.get("content"), str)
        ):
            raise UserError(
                f"{where}: messages[{position}] must be an object with string 'role' and "
                f"'content', got {message!r:.100}"
            )
    roles = [m["role"] for m in messages]
    consecutive = any(a == b == "assistant" for a, b in zip(roles, roles[1:], strict=False))
    if roles[0] == "assistant" or roles[-1] != "assistant" or consecutive:
        raise UserError(
            f"{where}: an SFT conversation starts with the prompt (system / user messages), "
            "ends with an assistant message, and has a tool or user message between two "
            f"assistant messages; its roles are {roles}"
        )
    return SFTConversation([dict(m) for m in messages], where)


def sft_corpus(rows: list[SFTRow]) -> list[str]:
    """The text of the rows (to train a locally built tokenizer on)."""
    texts = []
    for row in rows:
        if isinstance(row, tuple):
            texts.append(row[0] + row[1])
        else:
            texts.append("\n".join(m["content"] for m in row.messages))
            if isinstance(row, SFTImagePrompt):
                texts[-1] += row.response
    return texts
