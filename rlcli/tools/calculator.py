"""The built-in ``calculator`` tool: exact arithmetic on ``{"expression": "..."}``.

The expression is parsed with ``ast`` and evaluated node by node over a small whitelist (numbers,
``+ - * / // % **``, parentheses, ``abs``, ``min``, ``max``) with ``int`` / ``Fraction`` values, so
``0.1 + 0.2`` is exactly ``3/10`` and nothing is ever ``eval``-ed. Anything else (names,
attributes, calls to other functions, huge powers) is refused with an error text for the model.
"""

from __future__ import annotations

import ast
import operator
from fractions import Fraction
from typing import Any

from rlcli.tools.base import Tool, ToolResult
from rlcli.tools.schema import ToolSchema

MAX_EXPRESSION_CHARS = 1000
# Results and intermediates beyond this many bits (about 3000 digits) are refused: the bound keeps
# 9**9**9-style expressions from taking the trainer's time and memory.
MAX_BITS = 10_000

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS = {"abs": abs, "min": min, "max": max}
ALLOWED = "numbers, + - * / // % **, parentheses, abs(), min(), max()"


class CalculatorError(ValueError):
    """An expression the calculator does not evaluate; the message is meant for the model."""


def evaluate_expression(expression: str) -> Fraction:
    """The exact value of an arithmetic expression; ``CalculatorError`` says why not."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as error:
        raise CalculatorError(f"invalid expression: {error.msg}") from None
    except ValueError as error:  # null bytes
        raise CalculatorError(f"invalid expression: {error}") from None
    try:
        return _Evaluator(expression.strip()).value(tree.body)
    except RecursionError:
        raise CalculatorError("the expression is nested too deeply") from None


def format_number(value: Fraction) -> str:
    """An integer as digits, a terminating fraction as an exact decimal (``2.5``), any other as
    ``p/q`` with a decimal approximation (``1/3 (about 0.3333333333)``)."""
    if value.denominator == 1:
        return str(value.numerator)
    denominator = value.denominator
    for prime in (2, 5):
        while denominator % prime == 0:
            denominator //= prime
    if denominator == 1:
        return _exact_decimal(value)
    return f"{value.numerator}/{value.denominator} (about {float(value):.10g})"


def _exact_decimal(value: Fraction) -> str:
    sign = "-" if value < 0 else ""
    value = abs(value)
    digits = 0
    while (value * 10**digits).denominator != 1:
        digits += 1
    scaled = str((value * 10**digits).numerator).rjust(digits + 1, "0")
    return f"{sign}{scaled[:-digits]}.{scaled[-digits:]}"


class _Evaluator:
    def __init__(self, source: str) -> None:
        self.source = source

    def value(self, node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant):
            return self._constant(node)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = self.value(node.left), self.value(node.right)
            return _bounded(self._binary(node.op, left, right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](self.value(node.operand))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            return self._call(node)
        shown = ast.get_source_segment(self.source, node) or type(node).__name__
        raise CalculatorError(f"{shown!r} is not allowed; the calculator takes {ALLOWED}")

    def _constant(self, node: ast.Constant) -> Fraction:
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise CalculatorError(f"{node.value!r} is not a number")
        # The literal as written ("0.1"), not the float it parses to (0.1000000000000000055...).
        return Fraction(ast.get_source_segment(self.source, node) or repr(node.value))

    def _binary(self, op: ast.operator, left: Fraction, right: Fraction) -> Fraction:
        if isinstance(op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise CalculatorError("division by zero")
        if isinstance(op, ast.Pow):
            return _power(left, right)
        return Fraction(_BINARY[type(op)](left, right))

    def _call(self, node: ast.Call) -> Fraction:
        name = node.func.id  # type: ignore[attr-defined]
        if name not in _FUNCTIONS or node.keywords or not node.args:
            raise CalculatorError(f"{name}() is not allowed; the calculator takes {ALLOWED}")
        args = [self.value(arg) for arg in node.args]
        if name == "abs" and len(args) != 1:
            raise CalculatorError("abs() takes exactly one number")
        return _FUNCTIONS[name](*args) if name != "abs" else abs(args[0])


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        raise CalculatorError("only whole-number powers are exact; the exponent is a fraction")
    if base == 0 and exponent < 0:
        raise CalculatorError("division by zero (0 to a negative power)")
    size = max(base.numerator.bit_length(), base.denominator.bit_length())
    if size * abs(exponent.numerator) > MAX_BITS and abs(base) != 1:
        raise CalculatorError(f"the result is too large (more than {MAX_BITS} bits)")
    return Fraction(base) ** int(exponent)


def _bounded(value: Fraction) -> Fraction:
    if max(value.numerator.bit_length(), value.denominator.bit_length()) > MAX_BITS:
        raise CalculatorError(f"the result is too large (more than {MAX_BITS} bits)")
    return value


class CalculatorTool(Tool):
    """``calculator``: ``{"expression": "123 * 456"}`` -> ``56088``; errors start with ``Error:``."""

    schema = ToolSchema(
        name="calculator",
        description=(
            "Evaluate an arithmetic expression exactly. Supports integers and decimals, "
            "+ - * / // % **, parentheses, abs, min and max."
        ),
        parameters={
            "type": "object",
            "properties": {
                "expression": {"type": "string", "description": "e.g. (123 + 4) * 56"},
            },
            "required": ["expression"],
            "additionalProperties": False,
        },
    )

    def execute(self, state: Any, arguments: dict[str, Any]) -> ToolResult:
        try:
            value = evaluate_expression(arguments["expression"])
        except CalculatorError as error:
            return ToolResult(f"Error: {error}", metrics={"error": 1.0})
        return ToolResult(format_number(value), metrics={"error": 0.0})
