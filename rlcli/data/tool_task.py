"""The tool quickstart's task: ``What is A * B?`` for 3-digit A, B, with the ``calculator`` tool.

A model of the quickstart's size cannot multiply two 3-digit numbers itself, but it can copy
them into a calculator call and copy the result into its answer::

    user:       What is 347 * 582?
    assistant:  <tool_call>{"name": "calculator", "arguments": {"expression": "347 * 582"}}</tool_call>
    tool:       201954
    assistant:  #### 201954

The prompt rows are verl's agent-loop rows (``agent_name``, ``prompt`` messages,
``reward_model.ground_truth``, ``extra_info.tools_kwargs``), scored by the ``gsm8k`` reward's
strict rule (the number after the last ``####`` of the generated text). The SFT rows are whole
conversations (``{"messages": [...]}``): a share ``tool_share`` of them are traces like the one
above, the others answer at once with the right product, which a small model cannot learn to do.
At the tool quickstart's share (0.3, ``data.synthetic_tool_share``) the SFT model learns the
trace's format and copying, but answers at once when decoding greedily (wrongly: 0% held-out);
sampled, it calls the tool now and then, and those trajectories are the right ones, so GRPO
learns to call it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlcli.data.rows import write_jsonl

DATA_SOURCE = "tool_multiply"
LOW, HIGH = 100, 999  # both operands have three digits


@dataclass(frozen=True)
class MultiplyExample:
    a: int
    b: int

    @property
    def question(self) -> str:
        return f"What is {self.a} * {self.b}?"

    @property
    def answer(self) -> str:
        return f"#### {self.a * self.b}"

    @property
    def tool_call(self) -> str:
        call = {"name": "calculator", "arguments": {"expression": f"{self.a} * {self.b}"}}
        return f"<tool_call>{json.dumps(call)}</tool_call>"


def tool_multiply_split(
    num_train: int, num_val: int, seed: int = 0
) -> tuple[list[MultiplyExample], list[MultiplyExample]]:
    """``num_train`` training and ``num_val`` held-out problems, all distinct (seeded)."""
    side = HIGH - LOW + 1
    picked = np.random.default_rng(seed).choice(side * side, num_train + num_val, replace=False)
    examples = [MultiplyExample(LOW + int(i) // side, LOW + int(i) % side) for i in picked]
    return examples[num_val:], examples[:num_val]


def prompt_row(example: MultiplyExample, split: str, index: int) -> dict[str, Any]:
    """One prompt row in verl's agent-loop schema."""
    return {
        "data_source": DATA_SOURCE,
        "agent_name": "tool_agent",
        "prompt": [{"role": "user", "content": example.question}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": str(example.a * example.b)},
        "extra_info": {
            "split": split,
            "index": index,
            "tools_kwargs": {"calculator": {"create_kwargs": {}}},
        },
    }


def sft_conversation(
    example: MultiplyExample, use_tool: bool, tools: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """An SFT row: the tool-use trace, or the direct answer; ``tools``: the row's tools."""
    messages = [{"role": "user", "content": example.question}]
    if use_tool:
        messages += [
            {"role": "assistant", "content": example.tool_call},
            {"role": "tool", "name": "calculator", "content": str(example.a * example.b)},
        ]
    messages.append({"role": "assistant", "content": example.answer})
    return {"messages": messages, **({"tools": tools} if tools is not None else {})}


def write_tool_multiply_dataset(
    out_dir: str,
    num_train: int = 4000,
    num_val: int = 200,
    num_sft: int = 1000,
    tool_share: float = 1.0,
    seed: int = 0,
    tools: list[dict[str, Any]] | None = None,
) -> dict[str, str]:
    """Write ``train.jsonl`` / ``val.jsonl`` (prompt rows) and ``sft_train.jsonl`` (the first
    ``num_sft`` training problems as conversations, a ``tool_share`` of them with the tool, each
    row listing ``tools`` when given) into ``out_dir``; return their paths keyed ``train``, ``val``, ``sft_train``."""
    train, val = tool_multiply_split(num_train, num_val, seed)
    paths = {name: os.path.join(out_dir, f"{name}.jsonl") for name in ("train", "val", "sft_train")}
    write_jsonl(paths["train"], (prompt_row(e, "train", i) for i, e in enumerate(train)))
    write_jsonl(paths["val"], (prompt_row(e, "val", i) for i, e in enumerate(val)))
    uses_tool = np.random.default_rng([seed, 1]).random(num_sft) < tool_share
    write_jsonl(
        paths["sft_train"],
        (
            sft_conversation(e, bool(u), tools)
            for e, u in zip(train[:num_sft], uses_tool, strict=True)
        ),
    )
    return paths
