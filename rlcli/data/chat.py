"""A prompt and a response as one token sequence of a given tokenizer: how a reward model sees
a conversation (its preference data, and the policy's samples when its tokenizer differs).

With a chat template, a finished response is the assistant turn of
``messages + [{"role": "assistant", "content": response}]`` rendered by the template (which
writes its own special tokens and end-of-turn); an unfinished one (cut at the length limit) is
the generation prompt followed by the bare response text, so it does not look finished.
Without a template, as ``rlcli.data.dataset`` renders prompts: the message contents joined by
newlines, encoded with the tokenizer's usual special tokens, then the response's tokens and, when
finished, EOS (as a policy's finished sample ends).
"""

from __future__ import annotations

from typing import Any

from rlcli.errors import UserError


def uses_chat_template(tokenizer: Any, apply_chat_template: bool | None) -> bool:
    """``None``: whether the tokenizer has a chat template; ``True`` requires one."""
    has_template = getattr(tokenizer, "chat_template", None) is not None
    if apply_chat_template and not has_template:
        raise UserError(
            "apply_chat_template=True but the tokenizer has no chat_template; set it to "
            "false/auto or use a tokenizer with a chat template"
        )
    return has_template if apply_chat_template is None else bool(apply_chat_template)


def encode_prompt_and_response(
    tokenizer: Any,
    messages: list[dict[str, str]],
    response: str,
    *,
    use_template: bool,
    finished: bool = True,
) -> list[int]:
    """Token ids of the conversation `messages` + `response` (module docstring)."""
    if use_template:
        if finished:
            conversation = [*messages, {"role": "assistant", "content": response}]
            text = tokenizer.apply_chat_template(conversation, tokenize=False)
        else:
            prompt = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
            text = prompt + response
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    prompt_ids = tokenizer("\n".join(m["content"] for m in messages))["input_ids"]
    response_ids = tokenizer(response, add_special_tokens=False)["input_ids"]
    end = [tokenizer.eos_token_id] if finished and tokenizer.eos_token_id is not None else []
    return [*prompt_ids, *response_ids, *end]
