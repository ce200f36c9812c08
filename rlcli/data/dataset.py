"""Prompt datasets in the schema verl users already have, tokenized once at load time.

One row (JSONL line or Parquet row)::

    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": "Natalia sold clips ..."}],
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "72"},
     "extra_info": {"split": "train", "index": 0}}

``prompt`` is a list of chat messages (a plain string is accepted as one user message). A row
for a vision-language model may add ``images``, one per ``<image>`` placeholder in its messages
(``rlcli.data.images``); such rows are rendered and tokenized by the model's processor.
When the tokenizer has a chat template, the messages are rendered with it and the generation
prompt is appended (``add_generation_prompt=True``); the template writes its own special tokens,
so none are added on top. When it has none, the prompt text is the message contents joined by
newlines, encoded with the tokenizer's usual special tokens (e.g. a Llama BOS).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlcli.data.rows import RowLocation, read_rows
from rlcli.errors import UserError

logger = logging.getLogger(__name__)

_ENCODE_CHUNK = 1024  # rows per batched tokenizer call: fast, and bounded memory


@dataclass(frozen=True)
class PromptItem:
    """One tokenized prompt.

    ``index`` is the item's position in its ``PromptDataset`` (after length filtering);
    ``origin`` says where the row came from (``file, line N`` / ``file, row N``);
    ``prompt_messages`` are the row's chat messages (a reward model with another tokenizer
    renders them with its own chat template).
    """

    index: int
    prompt_token_ids: list[int]
    data_source: str
    ground_truth: Any
    extra_info: dict[str, Any] = field(default_factory=dict)
    prompt_text: str = ""
    origin: str = ""
    prompt_messages: list[dict[str, str]] = field(default_factory=list)
    # A vision-language row's images as loaded and as the model's processor made them
    # (``rlcli.data.images.ProcessedPrompt``: PIL images, pixel_values, grids, positions).
    image_inputs: Any = None

    @property
    def images(self) -> list[Any]:
        """The row's RGB PIL images (none for a text row)."""
        return self.image_inputs.images if self.image_inputs is not None else []


class PromptDataset(Sequence[PromptItem]):
    """The tokenized prompts of one or more files, in file order then row order."""

    def __init__(
        self,
        items: list[PromptItem],
        files: list[str],
        num_dropped_too_long: int,
        uses_chat_template: bool,
    ) -> None:
        self.items = items
        self.files = files
        self.num_dropped_too_long = num_dropped_too_long
        self.uses_chat_template = uses_chat_template

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> PromptItem:  # type: ignore[override]
        return self.items[index]

    def __iter__(self) -> Iterator[PromptItem]:
        return iter(self.items)

    def __repr__(self) -> str:
        return (
            f"PromptDataset({len(self.items)} prompts from {len(self.files)} file(s), "
            f"{self.num_dropped_too_long} dropped as too long)"
        )


@dataclass
class PromptRow:
    """One row of a prompt file, checked and not yet tokenized."""

    location: RowLocation
    messages: list[dict[str, str]]
    data_source: str
    ground_truth: Any
    extra_info: dict[str, Any]
    images: Any = None  # the row's ``images`` value, as read


def load_prompt_dataset(
    files: list[str] | str,
    tokenizer: Any,
    prompt_key: str = "prompt",
    max_prompt_length: int | None = None,
    apply_chat_template: bool | None = None,
    tools: list[dict[str, Any]] | None = None,
    processor: Any = None,
) -> PromptDataset:
    """Read, validate and tokenize prompt files (``.jsonl`` / ``.parquet``).

    Args:
        files: one path or a list of paths; rows keep file order.
        tokenizer: a Hugging Face tokenizer (``PreTrainedTokenizerBase``).
        prompt_key: the row key holding the chat messages.
        max_prompt_length: prompts with more tokens are dropped (counted in
            ``num_dropped_too_long`` and logged); ``None`` keeps all.
        apply_chat_template: ``None`` uses the chat template when the tokenizer has one;
            ``True`` requires one; ``False`` joins message contents.
        tools: OpenAI function schemas the chat template shows in the prompt (multi-turn
            rollouts with tools: the prompt the model sees lists them).
        processor: a vision-language model's ``AutoProcessor``: rows with ``images`` are
            rendered and tokenized by it (``rlcli.data.images``); without one such rows are
            refused.

    Raises ``UserError`` naming the file, the row and the key for every bad input, and when
    no prompt is left.
    """
    paths = [files] if isinstance(files, str) else list(files)
    parsed = read_prompt_rows(paths, prompt_key)
    has_template = getattr(tokenizer, "chat_template", None) is not None
    if apply_chat_template is None:
        use_template = has_template
    elif apply_chat_template and not has_template:
        raise UserError(
            "apply_chat_template=True but the tokenizer has no chat_template; "
            "set apply_chat_template to false/auto or use a tokenizer with a chat template"
        )
    else:
        use_template = bool(apply_chat_template)

    # Rows with images are rendered by the model's processor instead (below).
    texts = [
        _render_prompt(row, tokenizer, use_template, tools) if row.images is None else ""
        for row in parsed
    ]
    text_rows = [i for i, row in enumerate(parsed) if row.images is None]
    token_ids: dict[int, list[int]] = {}
    for start in range(0, len(text_rows), _ENCODE_CHUNK):
        chunk = text_rows[start : start + _ENCODE_CHUNK]
        encoded = tokenizer([texts[i] for i in chunk], add_special_tokens=not use_template)
        token_ids.update(zip(chunk, encoded["input_ids"], strict=True))

    items: list[PromptItem] = []
    num_dropped = 0
    for position, (row, text) in enumerate(zip(parsed, texts, strict=True)):
        image_inputs = None
        if row.images is None:
            ids = token_ids[position]
        else:
            image_inputs = _row_images(row, processor, prompt_key)
            ids, text = image_inputs.token_ids, image_inputs.text
        if max_prompt_length is not None and len(ids) > max_prompt_length:
            num_dropped += 1
            continue
        items.append(
            PromptItem(
                index=len(items),
                prompt_token_ids=list(ids),
                data_source=row.data_source,
                ground_truth=row.ground_truth,
                extra_info=row.extra_info,
                prompt_text=text,
                origin=str(row.location),
                prompt_messages=row.messages,
                image_inputs=image_inputs,
            )
        )
    if num_dropped:
        logger.warning(
            "dropped %d of %d prompts longer than max_prompt_length=%d tokens",
            num_dropped,
            len(parsed),
            max_prompt_length,
        )
    if not items:
        raise UserError(
            f"all {len(parsed)} prompts in {', '.join(paths)} are longer than "
            f"max_prompt_length={max_prompt_length} tokens; raise max_prompt_length"
        )
    logger.info("loaded %d prompts from %s", len(items), ", ".join(paths))
    return PromptDataset(items, paths, num_dropped, use_template)


def read_prompt_rows(paths: list[str], prompt_key: str = "prompt") -> list[PromptRow]:
    """Every row of the prompt files, checked without a tokenizer (so a launch can check them
    before it imports the training stack): ``UserError`` naming the file, the row and the key
    for a bad row, and when the files hold no row at all."""
    if not paths:
        raise UserError("no data files given: set at least one prompt file (.jsonl or .parquet)")
    parsed = [
        _parse_row(location, row, prompt_key) for path in paths for location, row in read_rows(path)
    ]
    if not parsed:
        raise UserError(f"no prompts in {', '.join(paths)}: the data files are empty")
    return parsed


def _parse_row(location: RowLocation, row: dict[str, Any], prompt_key: str) -> PromptRow:
    if prompt_key not in row or row[prompt_key] is None:
        raise UserError(
            f"{location}: missing key {prompt_key!r} (the chat messages "
            f'[{{"role": "user", "content": ...}}]); keys present: {sorted(row)}'
        )
    messages = parse_messages(row[prompt_key], location, prompt_key)

    data_source = row.get("data_source")
    if not isinstance(data_source, str) or not data_source:
        raise UserError(
            f"{location}: missing key 'data_source' (a string such as 'openai/gsm8k' that "
            "selects the reward function)"
        )

    reward_model = row.get("reward_model")
    if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
        raise UserError(
            f"{location}: missing key 'reward_model.ground_truth' (the reference answer, "
            'e.g. "reward_model": {"style": "rule", "ground_truth": "72"})'
        )

    extra_info = row.get("extra_info")
    if extra_info is None:
        extra_info = {}
    elif not isinstance(extra_info, dict):
        raise UserError(
            f"{location}: key 'extra_info' must be an object, got {type(extra_info).__name__}"
        )
    return PromptRow(
        location, messages, data_source, reward_model["ground_truth"], extra_info, row.get("images")
    )


def _row_images(row: PromptRow, processor: Any, prompt_key: str) -> Any:
    """A row's images and what the model's processor makes of them (``rlcli.data.images``)."""
    from rlcli.data.images import prompt_with_images

    if processor is None:
        raise UserError(
            f"{row.location}: the row has images, but the model has no image processor (a "
            "text-only model): use a vision-language model (model.path), or drop the "
            "row's 'images'"
        )
    return prompt_with_images(processor, row.messages, row.images, row.location, prompt_key)


def parse_messages(value: Any, location: RowLocation, prompt_key: str) -> list[dict[str, str]]:
    """A row's prompt as chat messages: a string is one user message; UserError naming the row
    and `prompt_key` for anything else than a non-empty list of {role, content} strings."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise UserError(
            f"{location}: key {prompt_key!r} must be a non-empty list of chat messages "
            f"or a string, got {type(value).__name__}"
        )
    messages = []
    for position, message in enumerate(value):
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or not isinstance(message.get("content"), str)
        ):
            raise UserError(
                f"{location}: key {prompt_key}[{position}] must be an object with string "
                f"'role' and 'content', got {message!r:.100}"
            )
        messages.append({"role": message["role"], "content": message["content"]})
    return messages


def _render_prompt(
    row: PromptRow, tokenizer: Any, use_template: bool, tools: list[dict[str, Any]] | None
) -> str:
    if not use_template:
        return "\n".join(message["content"] for message in row.messages)
    try:
        return tokenizer.apply_chat_template(
            row.messages,
            **({"tools": tools} if tools else {}),
            tokenize=False,
            add_generation_prompt=True,
        )
    except Exception as error:  # jinja raises for messages a template rejects
        raise UserError(f"{row.location}: the tokenizer's chat template failed: {error}") from error
