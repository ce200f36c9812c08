"""Token-in/token-out rendering: a trajectory built turn by turn from generated ids and rendered
tool / environment messages is exactly the chat template's rendering of the whole conversation."""

from __future__ import annotations

import pytest

from rlcli.errors import UserError
from rlcli.model.builder import train_tokenizer
from rlcli.tools.calculator import CalculatorTool
from rlcli.tools.rendering import TRUNCATED, MessageRenderer, TemplateNotIncremental, tool_message
from tests.rlcli.tools.chat_tokenizer import END_OF_TURN, build_chat_tokenizer

TOOLS = [CalculatorTool.schema.to_openai()]
PROMPT = [{"role": "user", "content": "What is 123 * 456 + 7? Use the calculator."}]
CALL = '<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{}"}}}}\n</tool_call>'
# (assistant turn text, tool responses that follow it); the last turn answers.
TURNS = [
    ("I will compute it.\n" + CALL.format("123 * 456"), ["56088"]),
    (CALL.format("56088 + 7") + "\n" + CALL.format("1 / 0"), ["56095", "Error: division by zero"]),
    ("The answer is #### 56095", []),
]


@pytest.fixture(scope="module", params=["qwen", "llama"])
def family_and_tokenizer(request, tmp_path_factory):
    family = request.param
    return family, build_chat_tokenizer(tmp_path_factory.mktemp(family), family)


def _encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _template_ids(tokenizer, messages, **kwargs):
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False, **kwargs)
    return _encode(tokenizer, text)


def test_three_turn_trajectory_equals_the_whole_conversation_rendered(family_and_tokenizer):
    """The engine stops at the end-of-turn token (no newline after it); the renderer closes each
    turn and appends the tool messages; the result is the template's rendering, token for token."""
    family, tokenizer = family_and_tokenizer
    renderer = MessageRenderer(tokenizer, TOOLS)
    end_of_turn = tokenizer.convert_tokens_to_ids(END_OF_TURN[family])
    ids = renderer.prompt_ids(PROMPT)
    assert ids == _template_ids(tokenizer, PROMPT, add_generation_prompt=True)
    messages = list(PROMPT)
    generated_mask = [0] * len(ids)
    for text, responses in TURNS:
        generated = _encode(tokenizer, text) + [end_of_turn]  # what the engine returns
        ids += generated
        generated_mask += [1] * len(generated)
        messages.append({"role": "assistant", "content": text})
        if responses:
            appended = renderer.append_ids(
                generated, [tool_message("calculator", r) for r in responses]
            )
            ids += appended
            generated_mask += [0] * len(appended)
            messages += [{"role": "tool", "content": r} for r in responses]
    whole = _template_ids(tokenizer, messages)
    # The whole rendering closes the last turn too (Qwen: a newline after <|im_end|>).
    assert ids + renderer.closing_tail(ids) == whole
    # The generated tokens are exactly the assistant turns' tokens, nothing else.
    generated_ids = [t for t, m in zip(ids, generated_mask, strict=True) if m]
    expected = [t for text, _ in TURNS for t in _encode(tokenizer, text) + [end_of_turn]]
    assert generated_ids == expected


def test_a_turn_cut_by_the_length_limit_is_closed_by_the_renderer(family_and_tokenizer):
    family, tokenizer = family_and_tokenizer
    renderer = MessageRenderer(tokenizer, TOOLS)
    cut = "I will compute"
    generated = _encode(tokenizer, cut)  # no end-of-turn token: the engine ran out of tokens
    ids = renderer.prompt_ids(PROMPT) + generated
    ids += renderer.append_ids(generated, [{"role": "user", "content": "Go on."}])
    messages = [
        *PROMPT,
        {"role": "assistant", "content": cut},
        {"role": "user", "content": "Go on."},
    ]
    assert ids == _template_ids(tokenizer, messages, add_generation_prompt=True)
    assert renderer.closing_tail(generated) == renderer.closing_ids
    assert renderer.closing_ids[0] == tokenizer.convert_tokens_to_ids(END_OF_TURN[family])


def test_qwen_closing_is_end_of_turn_and_newline(family_and_tokenizer):
    family, tokenizer = family_and_tokenizer
    renderer = MessageRenderer(tokenizer, TOOLS)
    tokens = tokenizer.convert_ids_to_tokens(renderer.closing_ids)
    assert tokens == (["<|im_end|>", "Ċ"] if family == "qwen" else ["<|eot_id|>"])


def test_a_tokenizer_without_chat_template_is_a_user_error():
    tokenizer = train_tokenizer(["plain text 123"] * 4, vocab_size=300)
    assert tokenizer.chat_template is None
    with pytest.raises(
        UserError, match="needs a tokenizer with a chat template.*model.tokenizer_path"
    ):
        MessageRenderer(tokenizer)


def test_a_template_that_rewrites_history_is_refused(family_and_tokenizer):
    _, tokenizer = family_and_tokenizer
    tokenizer = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    # The first line counts the messages, so appending any message changes the earlier text.
    tokenizer.chat_template = (
        "{{ messages | length }} messages\n"
        "{%- for m in messages %}{{ m.role + ': ' + m.content + '\\n' }}{%- endfor %}"
    )
    renderer = MessageRenderer(tokenizer)
    with pytest.raises(TemplateNotIncremental, match="renders the earlier turns differently"):
        renderer.messages_ids([tool_message("calculator", "4")])


@pytest.mark.parametrize("side", ["left", "right", "middle"])
def test_truncation_keeps_the_chosen_side(family_and_tokenizer, side):
    _, tokenizer = family_and_tokenizer
    renderer = MessageRenderer(tokenizer, TOOLS)
    text = " ".join(str(n) for n in range(200))
    assert renderer.truncate(text, 10_000, side) == text
    cut = renderer.truncate(text, 40, side)
    assert TRUNCATED in cut and len(cut) < len(text)
    assert len(_encode(tokenizer, cut)) <= 40 + 2  # re-encoding the joined pieces may shift a token
    head, _, tail = cut.partition(TRUNCATED)
    if side == "right":
        assert text.startswith(head) and head and not tail
    elif side == "left":
        assert text.endswith(tail) and tail and not head
    else:
        assert text.startswith(head) and text.endswith(tail) and head and tail
