"""Token-in/token-out: the token ids a trajectory appends after an assistant turn.

A multi-turn trajectory is never decoded and re-encoded: decoding generated ids and tokenizing the
text again can give other ids (and PPO on ids the engine did not sample goes wrong). Instead each
tool / environment message is rendered *alone* with the tokenizer's chat template: the template is
applied to a fixed conversation ending in an assistant turn, with and without the new messages,
and the ids the new messages add are the difference. Checked on every call: the shorter rendering
must be a prefix of the longer one, in text and in token ids, or the template is not incremental
and ``TemplateNotIncremental`` says so.

The engine stops at the end-of-turn token (``<|im_end|>``) and never produces what the template
puts after it (a newline for Qwen): ``append_ids`` first adds whatever part of the template's
closing of an assistant turn the generated ids lack.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from rlcli.errors import UserError

TruncateSide = Literal["left", "right", "middle"]
TRUNCATED = "...(truncated)..."
# A fixed conversation the new messages are rendered after; its content never reaches a model.
_CONTENT = "rlcli-assistant-content"
_BASE = [
    {"role": "user", "content": "rlcli-user-content"},
    {"role": "assistant", "content": _CONTENT},
]


class TemplateNotIncremental(UserError):
    """The chat template renders a conversation's earlier messages differently once later ones
    are added, so appended messages cannot be rendered on their own."""


class MessageRenderer:
    """Renders a trajectory's non-generated messages into token ids with ``tokenizer``'s chat
    template; ``tools`` are the OpenAI function schemas the prompt shows (they shape the system
    prompt, so the same list must be used for the prompt and for every later turn).

    ``tokenizer_setting`` names the config key of the tokenizer in errors.
    """

    def __init__(
        self,
        tokenizer: Any,
        tools: list[dict[str, Any]] | None = None,
        tokenizer_setting: str = "model.tokenizer_path",
    ) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise UserError(
                f"rollout.multi_turn needs a tokenizer with a chat template, and the tokenizer of "
                f"{tokenizer_setting} has none: use a chat model's tokenizer, or give the "
                "tokenizer one (tokenizer.chat_template = '...'; save_pretrained)"
            )
        self.tokenizer = tokenizer
        self.tools = tools or None
        self._base_text = self._render(_BASE, add_generation_prompt=False)
        self._base_ids = self._encode(self._base_text)
        self.closing_ids = self._assistant_closing_ids()

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """The first turn's prompt: ``messages`` rendered with the tools and the generation prompt."""
        return self._encode(self._render(messages, add_generation_prompt=True))

    def append_ids(self, generated_ids: Sequence[int], messages: list[dict[str, Any]]) -> list[int]:
        """The ids to append after an assistant turn's ``generated_ids``: the part of the template's
        end-of-turn the engine did not generate, then ``messages`` (the tool responses of the
        turn, or an environment's user message), then the next assistant turn's header."""
        return self.closing_tail(generated_ids) + self.messages_ids(messages)

    def closing_tail(self, generated_ids: Sequence[int]) -> list[int]:
        """What closes the assistant turn after ``generated_ids``: for Qwen, ``["\\n"]`` after a
        turn that ended in ``<|im_end|>``, both tokens after a turn cut by the length limit."""
        closing = self.closing_ids
        for have in range(len(closing), 0, -1):
            if list(generated_ids[-have:]) == closing[:have]:
                return closing[have:]
        return list(closing)

    def messages_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """``messages`` after a closed assistant turn, then the generation prompt."""
        if not messages:
            raise ValueError("messages_ids needs at least one message")
        text = self._render(_BASE + list(messages), add_generation_prompt=True)
        if not text.startswith(self._base_text):
            raise TemplateNotIncremental(
                "the chat template renders the earlier turns differently once "
                f"{[m.get('role') for m in messages]} messages follow an assistant turn; "
                "rollout.multi_turn cannot append them token-in/token-out"
            )
        ids = self._encode(text)
        if ids[: len(self._base_ids)] != self._base_ids:
            raise TemplateNotIncremental(
                "the tokenizer merges the end of an assistant turn with the next message's "
                "tokens, so appended messages cannot be tokenized on their own"
            )
        return ids[len(self._base_ids) :]

    def truncate(self, text: str, max_tokens: int, side: TruncateSide) -> str:
        """``text`` cut to about ``max_tokens`` tokens (marker included), keeping its start
        (``right``: the right end is cut), its end (``left``) or both ends (``middle``)."""
        ids = self._encode(text)
        if len(ids) <= max_tokens:
            return text
        keep = max(max_tokens - len(self._encode(TRUNCATED)), 0)
        decode = self.tokenizer.decode
        if side == "right":
            return decode(ids[:keep]) + TRUNCATED
        if side == "left":
            return TRUNCATED + decode(ids[len(ids) - keep :])
        head = keep - keep // 2
        return decode(ids[:head]) + TRUNCATED + decode(ids[len(ids) - keep // 2 :])

    def _assistant_closing_ids(self) -> list[int]:
        """The ids the template puts after an assistant message's content (``<|im_end|>\\n``)."""
        if self._base_text.count(_CONTENT) != 1:
            raise TemplateNotIncremental(
                "the chat template does not render an assistant message's content verbatim"
            )
        closing = self._encode(self._base_text.split(_CONTENT, 1)[1])
        if closing and self._base_ids[-len(closing) :] != closing:
            raise TemplateNotIncremental(
                "the tokenizer merges an assistant message's content with the template's "
                "end-of-turn text, so generated turns cannot be closed token by token"
            )
        return closing

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages,
                tools=self.tools,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
            )
        except Exception as error:  # jinja raises for conversations a template rejects
            roles = [m.get("role") for m in messages]
            raise UserError(
                f"the tokenizer's chat template cannot render a conversation of roles {roles} "
                f"(rollout.multi_turn appends tool / user messages after assistant turns): {error}"
            ) from error

    def _encode(self, text: str) -> list[int]:
        # What apply_chat_template(tokenize=True) does: the rendered text, no special tokens added.
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def tool_message(name: str | None, text: str) -> dict[str, Any]:
    """A ``tool`` role message for one call's response."""
    message: dict[str, Any] = {"role": "tool", "content": text}
    if name is not None:
        message["name"] = name
    return message
