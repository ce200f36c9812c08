"""Agents written as users write them: plain functions with the ``openai`` SDK, for the agent
endpoint's tests (``rollout.agent=tests.rlcli.openai_agents:<name>``).

``RECEIVED`` keeps what each agent got back, by row index, so an in-process test can compare it
with what the run captured."""

from __future__ import annotations

import asyncio
import json
import time

from openai import AsyncOpenAI, OpenAI

from rlcli.tools.calculator import CalculatorTool
from rlcli.tools.parsing import parse_hermes
from tests.rlcli.multi_turn_model import TOOLS

RECEIVED: dict[int, list] = {}


def _client(base_url: str, api_key: str) -> OpenAI:
    return OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)


def calculator_agent(base_url, api_key, model, row):
    """Asks the question with ``tools=[calculator]``, runs every call the model makes with the
    real calculator and answers with its result, until the model answers without a call; the
    run's reward function scores the conversation (returns None)."""
    client = _client(base_url, api_key)
    messages = list(row["prompt"])
    got = RECEIVED.setdefault(row["index"], [])
    for _ in range(4):
        reply = client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, logprobs=True
        )
        message = reply.choices[0].message
        got.append(reply)
        messages.append(message.model_dump(exclude_none=True))
        if message.tool_calls:
            for call in message.tool_calls:
                result = CalculatorTool().execute({}, json.loads(call.function.arguments)).text
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": call.id,
                        "name": "calculator",
                        "content": result,
                    }
                )
        elif "<tool_call>" in (message.content or ""):  # a call the endpoint could not parse
            error = parse_hermes(message.content).calls[0].error
            messages.append({"role": "tool", "name": "calculator", "content": error})
        else:
            return None
    return None


def streaming_calculator_agent(base_url, api_key, model, row):
    """``calculator_agent`` with ``stream=True``, reading each reply as a streaming client does
    (content and tool-call deltas joined); keeps per call (content, tool calls, finish reason,
    log-probs, usage) in ``RECEIVED``."""
    client = _client(base_url, api_key)
    messages = list(row["prompt"])
    got = RECEIVED.setdefault(row["index"], [])
    for _ in range(4):
        stream = client.chat.completions.create(
            model=model,
            messages=messages,
            tools=TOOLS,
            logprobs=True,
            stream=True,
            stream_options={"include_usage": True},
        )
        content, calls, finish, log_probs, usage = "", {}, None, [], None
        for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                content += choice.delta.content or ""
                for call in choice.delta.tool_calls or []:
                    joined = calls.setdefault(call.index, {"id": call.id, "name": "", "args": ""})
                    joined["name"] += call.function.name or ""
                    joined["args"] += call.function.arguments or ""
                if choice.logprobs is not None:
                    log_probs += [t.logprob for t in choice.logprobs.content or []]
                finish = choice.finish_reason or finish
        got.append((content or None, list(calls.values()), finish, log_probs, usage))
        message = {"role": "assistant", "content": content or None}
        if calls:
            message["tool_calls"] = [
                {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["args"]}}
                for c in calls.values()
            ]  # fmt: skip
        messages.append(message)
        for call in calls.values():
            result = CalculatorTool().execute({}, json.loads(call["args"])).text
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call["id"],
                    "name": "calculator",
                    "content": result,
                }
            )
        if not calls and "<tool_call>" in content:
            error = parse_hermes(content).calls[0].error
            messages.append({"role": "tool", "name": "calculator", "content": error})
        elif not calls:
            return None
    return None


async def streaming_text_agent(base_url, api_key, model, row):
    """One streamed ``/v1/completions`` call; keeps the joined text and finish reason."""
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    stream = await client.completions.create(
        model=model, prompt=f"row {row['index']}", max_tokens=4, stream=True
    )
    text, finish = "", None
    async for chunk in stream:
        for choice in chunk.choices:
            text += choice.text
            finish = choice.finish_reason or finish
    RECEIVED.setdefault(row["index"], []).append((text, finish))
    return float(row["index"])


def editing_agent(base_url, api_key, model, row):
    """Calls twice, but rewrites its first answer before the second call: a split."""
    client = _client(base_url, api_key)
    messages = list(row["prompt"])
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=8)
    messages += [
        {
            "role": "assistant",
            "content": "(summarised) " + (first.choices[0].message.content or ""),
        },
        {"role": "user", "content": "Go on."},
    ]
    client.chat.completions.create(model=model, messages=messages, max_tokens=8)
    return 1.0


def numbered_agent(base_url, api_key, model, row):
    """One call whose prompt names the row; returns the row's index as its reward."""
    index = row["index"]
    client = _client(base_url, api_key)
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": f"row {index}"}], max_tokens=6
    )
    RECEIVED.setdefault(index, []).append(reply.choices[0].message.content)
    return float(index)


async def async_numbered_agent(base_url, api_key, model, row):
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    reply = await client.completions.create(model=model, prompt=f"row {row['index']}", max_tokens=4)
    RECEIVED.setdefault(row["index"], []).append(reply.choices[0].text)
    return float(row["index"])


def top_logprobs_agent(base_url, api_key, model, row):
    """Asks for top_logprobs (not served: a 400), then calls without them."""
    from openai import BadRequestError

    client = _client(base_url, api_key)
    try:
        client.chat.completions.create(
            model=model, messages=row["prompt"], max_tokens=4, logprobs=True, top_logprobs=2
        )
    except BadRequestError as error:
        RECEIVED.setdefault(row["index"], []).append(error.message)
    client.chat.completions.create(model=model, messages=row["prompt"], max_tokens=4)
    return 1.0


def failing_agent(base_url, api_key, model, row):
    """Odd rows: calls the model, then raises; even rows: asks for a model that does not exist."""
    client = _client(base_url, api_key)
    if row["index"] % 2:
        client.chat.completions.create(model=model, messages=row["prompt"], max_tokens=4)
        raise RuntimeError(f"agent bug on row {row['index']}")
    client.chat.completions.create(model="gpt-4o", messages=row["prompt"], max_tokens=4)
    return 1.0


def slow_agent(base_url, api_key, model, row):
    time.sleep(30)


async def slow_async_agent(base_url, api_key, model, row):
    await asyncio.sleep(30)


def wrong_return_agent(base_url, api_key, model, row):
    _client(base_url, api_key).chat.completions.create(
        model=model, messages=row["prompt"], max_tokens=4
    )
    return "correct"


NOT_AN_AGENT = 3
