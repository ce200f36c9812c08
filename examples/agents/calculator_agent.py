"""An agent as users write them: a plain function with the ``openai`` SDK and one tool.

rlcli calls it once per sample with the endpoint's ``base_url``, ``api_key`` and ``model`` and
the data row, while it trains (``rollout.agent: examples/agents/calculator_agent.py:agent``,
``recipes/agent_quickstart.yaml``). Nothing here knows about rlcli: point ``base_url`` at any
OpenAI-compatible server (``rlcli serve``, vLLM, ...) and it runs the same.
"""

from __future__ import annotations

import ast
import json
import operator

from openai import BadRequestError, DefaultHttpxClient, OpenAI

# The tool as the model saw it in its SFT conversations (the schema shapes the system prompt).
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": (
            "Evaluate an arithmetic expression exactly. Supports integers and decimals, "
            "+ - * / // % **, parentheses, abs, min and max."
        ),
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. (123 + 4) * 56"}},
            "required": ["expression"],
            "additionalProperties": False,
        },
    },
}

_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
}


def calculate(expression: str) -> str:
    """The value of an arithmetic expression, or an error text the model can read."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        raise ValueError("only numbers and + - * / ** are allowed")

    try:
        result = value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as error:
        return f"Error: {error}"
    return str(int(result)) if float(result).is_integer() else str(result)


# One HTTP connection pool for all the agents of the process: a new OpenAI client builds its own
# (with an SSL context), about 25 ms of CPU each, which hundreds of agents a step would pay.
_HTTP = DefaultHttpxClient()


def agent(base_url: str, api_key: str, model: str, row: dict, max_turns: int = 3) -> None:
    """Ask the row's question offering the calculator; run each call the model makes and send
    back its result, until the model answers without a call (or ``max_turns`` answers). Returns
    None: the run's reward function scores the conversation."""
    client = OpenAI(base_url=base_url, api_key=api_key, http_client=_HTTP)
    messages = list(row["prompt"])
    for _ in range(max_turns):
        try:
            reply = client.chat.completions.create(
                model=model, messages=messages, tools=[CALCULATOR]
            )
        except BadRequestError as error:
            if error.code == "context_length_exceeded":  # the episode's token budget is spent
                return None
            raise
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return None
        for call in message.tool_calls:
            try:
                expression = json.loads(call.function.arguments).get("expression", "")
            except (json.JSONDecodeError, AttributeError):
                expression = ""
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call.id,
                    "name": "calculator",
                    "content": calculate(str(expression)),
                }
            )
    return None
