"""A process reward: score each arithmetic step of a solution, not only its final answer.

Use it as ``reward: examples/process_reward.py:compute_score``. Every ``a + b = c``-style
equation in the response is a step (``48/2 = 24``, ``48 + 24 = 72``, ``3 * (2 + 1) = 9``; GSM8K's
``<<48/2=24>>`` calculator notes count too); a step scores 1.0 when its left side evaluates to its
right side. The final answer is the number after ``####``, compared with the ground truth.

    score = 0.5 * final answer correct + 0.5 * fraction of correct steps

The result also carries ``step_scores`` and ``step_end_chars`` (the character offset where each
step ends in ``solution_str``), so a trainer can place a step's reward on the token that ends it.
"""

from __future__ import annotations

import ast
import operator
import re
from typing import Any

from rlcli.rewards.gsm8k import compute_score as gsm8k_score

_NUM = r"\d[\d,]*(?:\.\d+)?"
_EQUATION = re.compile(
    rf"(?P<lhs>[-(]*{_NUM}[)]*(?:\s*[-+*/×]\s*[(]*-?{_NUM}[)]*)+)\s*=\s*(?P<rhs>-?{_NUM})"
)
_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def _evaluate(node: ast.AST) -> float:
    """Evaluate a parsed arithmetic expression: numbers and + - * / only (no names, no calls)."""
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return float(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"not arithmetic: {ast.dump(node)}")


def step_scores(solution_str: str) -> tuple[list[float], list[int]]:
    """``(scores, end offsets)`` of every equation step in the text, in order."""
    scores, ends = [], []
    for match in _EQUATION.finditer(solution_str):
        lhs = match["lhs"].replace(",", "").replace("×", "*")
        rhs = float(match["rhs"].replace(",", ""))
        try:
            value = _evaluate(ast.parse(lhs, mode="eval"))
            correct = abs(value - rhs) <= 1e-6 * max(1.0, abs(rhs))
        except (SyntaxError, ValueError, ZeroDivisionError):
            correct = False
        scores.append(float(correct))
        ends.append(match.end())
    return scores, ends


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``{"score", "acc", "step_scores", "step_end_chars", "num_steps"}`` for one response."""
    final = gsm8k_score(data_source, solution_str, ground_truth, method="strict")["acc"]
    scores, ends = step_scores(solution_str)
    step_fraction = sum(scores) / len(scores) if scores else 0.0
    return {
        "score": 0.5 * final + 0.5 * step_fraction,
        "acc": final,
        "step_scores": scores,
        "step_end_chars": ends,
        "num_steps": len(scores),
    }
