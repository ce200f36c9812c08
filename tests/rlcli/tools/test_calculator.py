"""The calculator: exact arithmetic (checked against Python's own integer / Fraction arithmetic),
and a refusal with an error text for anything that is not arithmetic."""

from __future__ import annotations

import random
from fractions import Fraction

import pytest

from rlcli.tools.calculator import (
    MAX_BITS,
    CalculatorError,
    CalculatorTool,
    evaluate_expression,
    format_number,
)


def _call(expression: str) -> str:
    return CalculatorTool().execute(None, {"expression": expression}).text


def test_three_digit_products_are_exact():
    rng = random.Random(0)
    for _ in range(200):
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        assert _call(f"{a} * {b}") == str(a * b)


@pytest.mark.parametrize(
    "expression, value",
    [
        ("0.1 + 0.2", Fraction(3, 10)),  # exact, not 0.30000000000000004
        ("1/3 + 1/6", Fraction(1, 2)),
        ("2**100", Fraction(2**100)),
        ("-7 // 2", Fraction(-4)),
        ("-7 % 3", Fraction(2)),
        ("2 ** -2", Fraction(1, 4)),
        ("(1 + 2) * (3 - 4) / 5", Fraction(-3, 5)),
        ("abs(-3) + max(1, 2.5) - min(4, 5)", Fraction(3, 2)),
        ("1e3 + 1.5e-1", Fraction(20003, 20)),
        ("0.1000000000000000055511151231257827", Fraction("0.1000000000000000055511151231257827")),
    ],
)
def test_values_equal_fraction_arithmetic(expression, value):
    assert evaluate_expression(expression) == value


@pytest.mark.parametrize(
    "value, text",
    [
        (Fraction(56088), "56088"),
        (Fraction(5, 2), "2.5"),
        (Fraction(-3, 8), "-0.375"),
        (Fraction(1, 3), "1/3 (about 0.3333333333)"),
    ],
)
def test_format(value, text):
    assert format_number(value) == text


@pytest.mark.parametrize(
    "expression, message",
    [
        ("__import__('os').system('true')", "not allowed"),
        ("open('/etc/passwd').read()", "not allowed"),
        ("x + 1", "'x' is not allowed"),
        ("(1).__class__", "not allowed"),
        ("[1, 2]", "not allowed"),
        ("lambda: 1", "not allowed"),
        ("'a' * 3", "is not a number"),
        ("True + 1", "is not a number"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("9 ** 9 ** 9", "too large"),
        ("2 ** 0.5", "whole-number powers"),
        ("1 +", "invalid expression"),
        ("abs(1, 2)", "exactly one number"),
        ("max(x=1)", "not allowed"),
        ("1" * 1001, "longer than"),
        ("(" * 100 + "1" + ")" * 100, ""),  # deep but legal
    ],
)
def test_refusals_are_error_texts(expression, message):
    text = _call(expression)
    if not message:
        assert text == "1"
        return
    assert text.startswith("Error: ") and message in text, text


def test_intermediate_results_are_bounded():
    big = "*".join(["(2**5000)"] * 3)
    with pytest.raises(CalculatorError, match="too large"):
        evaluate_expression(big)
    assert evaluate_expression("2**5000 * 2**4999") == 2**9999
    assert MAX_BITS == 10_000


def test_eval_is_never_reached(monkeypatch):
    """Replacing the builtins eval / exec with bombs changes nothing: nothing calls them."""
    import builtins

    def bomb(*args, **kwargs):
        raise AssertionError("eval/exec called")

    monkeypatch.setattr(builtins, "eval", bomb)
    monkeypatch.setattr(builtins, "exec", bomb)
    assert _call("(12 + 3) * 4") == "60"
