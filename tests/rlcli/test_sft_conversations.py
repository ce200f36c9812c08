"""SFT on whole conversations: tokenized as a multi-turn rollout builds a trajectory, with the loss
on the assistant turns only (tool responses masked out of the SFT loss too)."""

from __future__ import annotations

import json

import pytest
import torch

from parallel.step_types import ModelOutputs
from rlcli.data.sft_rows import SFTConversation, read_sft_rows, sft_corpus
from rlcli.errors import UserError
from rlcli.model.builder import train_tokenizer
from rlcli.rollout.batch import collate
from rlcli.tools.calculator import CalculatorTool
from rlcli.tools.rendering import MessageRenderer
from rlcli.train.sft import generated_tokens, make_sft_loss, tokenize_conversations

TOOLS = [CalculatorTool.schema.to_openai()]
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 34"}}</tool_call>'
MESSAGES = [
    {"role": "system", "content": "Use the tools."},
    {"role": "user", "content": "What is 12 * 34?"},
    {"role": "assistant", "content": CALL},
    {"role": "tool", "name": "calculator", "content": "408"},
    {"role": "assistant", "content": "#### 408"},
]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer([m["content"] for m in MESSAGES] * 8, 300, chat_template="chatml")


def _encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_conversation_is_its_rendering_with_the_loss_on_assistant_turns(tokenizer):
    renderer = MessageRenderer(tokenizer, TOOLS)
    [sample] = tokenize_conversations([SFTConversation(MESSAGES, "x")], renderer)
    rendered = tokenizer.apply_chat_template(MESSAGES, tools=TOOLS, tokenize=False)
    whole = _encode(tokenizer, rendered)
    ids = sample.prompt_ids + sample.response_ids
    assert ids + _encode(tokenizer, "\n") == whole  # all but the newline after the last turn
    assert sample.prompt_ids == _encode(
        tokenizer,
        tokenizer.apply_chat_template(
            MESSAGES[:2], tools=TOOLS, tokenize=False, add_generation_prompt=True
        ),
    )
    generated = [t for t, m in zip(sample.response_ids, sample.loss_mask, strict=True) if m]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert generated == _encode(tokenizer, CALL) + [end] + _encode(tokenizer, "#### 408") + [end]
    # The tool response is in the sequence, with no loss on it.
    masked = [t for t, m in zip(sample.response_ids, sample.loss_mask, strict=True) if not m]
    assert "<tool_response>\n408\n</tool_response>" in tokenizer.decode(masked)
    assert generated_tokens(sample) == len(generated)


def test_the_sft_loss_counts_only_the_assistant_tokens(tokenizer):
    renderer = MessageRenderer(tokenizer, TOOLS)
    [sample] = tokenize_conversations([SFTConversation(MESSAGES, "x")], renderer)
    batch = collate([sample], pad_id=tokenizer.pad_token_id)
    log_probs = -torch.rand(1, batch.input_ids.shape[1] - 1, dtype=torch.float32) - 0.1
    loss, _ = make_sft_loss(float(generated_tokens(sample)))(
        ModelOutputs(log_probs=log_probs), batch
    )
    start = len(sample.prompt_ids) - 1
    per_token = [-log_probs[0, start + j].item() for j, m in enumerate(sample.loss_mask) if m]
    assert loss.item() == pytest.approx(sum(per_token) / len(per_token), rel=1e-6)


def test_sft_rows_are_read_and_checked(tmp_path):
    path = tmp_path / "sft.jsonl"
    rows = [
        {"prompt": "Question: 1 + 1 = ? Answer:", "response": " #### 2"},
        {"messages": MESSAGES},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pair, conversation = read_sft_rows(str(path))
    assert pair == ("Question: 1 + 1 = ? Answer:", " #### 2")
    assert conversation.prompt == MESSAGES[:2] and conversation.origin == f"{path}, line 2"
    assert sft_corpus([pair])[0] == "Question: 1 + 1 = ? Answer: #### 2"
    for bad, why in (
        ({"messages": MESSAGES[:-1]}, "ends with an assistant message"),
        ({"messages": MESSAGES[:3] + MESSAGES[2:3]}, "ends with an assistant message"),
        ({"messages": [{"role": "user"}]}, r"messages\[0\] must be an object"),
        ({"prompt": "x"}, "'response' is missing"),
    ):
        path.write_text(json.dumps(rows[0]) + "\n" + json.dumps(bad) + "\n")
        with pytest.raises(UserError, match=f"{path}, line 2: .*{why}"):
            read_sft_rows(str(path))


def test_a_row_with_its_own_tools_is_rendered_with_them(tokenizer, tmp_path):
    """An SFT row's ``tools`` (the HF / TRL convention) shape its system prompt, as an agent
    offering those tools through the endpoint sees it; rows without use the run's (none here)."""
    from types import SimpleNamespace

    from rlcli.config.schema import RLConfig
    from rlcli.train.sft import tokenize_rows

    path = tmp_path / "sft.jsonl"
    rows = [{"messages": MESSAGES, "tools": TOOLS}, {"messages": MESSAGES}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with_tools, without = read_sft_rows(str(path))
    assert with_tools.tools == TOOLS and without.tools is None
    samples = tokenize_rows(
        [with_tools, without], SimpleNamespace(cfg=RLConfig(), tokenizer=tokenizer)
    )
    for sample, tools in zip(samples, (TOOLS, None), strict=True):
        rendered = tokenizer.apply_chat_template(MESSAGES, tools=tools, tokenize=False)
        assert sample.prompt_ids + sample.response_ids + _encode(tokenizer, "\n") == _encode(
            tokenizer, rendered
        )
    assert len(samples[0].prompt_ids) > len(samples[1].prompt_ids)  # the tools' system prompt
    path.write_text(json.dumps({"messages": MESSAGES, "tools": "calculator"}) + "\n")
    with pytest.raises(UserError, match="line 1: 'tools' must be a list of OpenAI function"):
        read_sft_rows(str(path))


def test_the_example_agent_offers_the_calculator_the_sft_rows_list():
    """examples/agents/calculator_agent.py shows the model the system prompt it was trained with."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "agents" / "calculator_agent.py"
    spec = importlib.util.spec_from_file_location("calculator_agent", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.CALCULATOR == TOOLS[0]
    for expression in ("974 * 656", "(123 + 4) * 56", "7 / 2", "2 ** 10"):
        assert (
            module.calculate(expression)
            == CalculatorTool().execute({}, {"expression": expression}).text
        )
