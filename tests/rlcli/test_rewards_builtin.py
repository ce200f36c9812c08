"""Builtin rewards: GSM8K parsing, math-verify on boxed answers, arith, default dispatch."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from rlcli.errors import UserError
from rlcli.rewards import default_compute_score, get_reward_fn, resolve_reward_fn
from rlcli.rewards.math_answer import last_boxed_content


def _gsm8k(solution: str, ground_truth: str, **kwargs) -> float:
    return get_reward_fn("gsm8k")("openai/gsm8k", solution, ground_truth, **kwargs)["score"]


@pytest.mark.parametrize(
    "solution, ground_truth, strict, flexible",
    [
        ("48 + 24 = 72 clips.\n#### 72", "72", 1.0, 1.0),
        ("She sold 72 clips altogether.", "72", 0.0, 1.0),  # no '####': strict finds nothing
        ("The total is 1,234 dollars.\n#### 1,234", "1234", 1.0, 1.0),
        ("#### $1,234.00", "1234", 1.0, 1.0),  # $, separator and .00 all normalised
        ("#### 1,000,000", "1000000", 1.0, 1.0),
        ("It drops 8 degrees to #### -5", "-5", 1.0, 1.0),
        ("#### 5", "-5", 0.0, 0.0),
        ("She owes -$5 in the end. #### -$5", "-5", 1.0, 1.0),
        ("#### 0.5", "0.50", 1.0, 1.0),
        ("#### .5", "0.5", 1.0, 1.0),
        ("#### 3.5", "3", 0.0, 0.0),
        ("first #### 3, then corrected: #### 4", "4", 1.0, 1.0),  # the last answer counts
        ("#### 4\nbut then I wrote 3 more words", "4", 1.0, 0.0),  # flexible: last number
        ("So the answer is 72.", "72", 0.0, 1.0),  # a full stop is not a decimal point
        ("no numbers at all", "72", 0.0, 0.0),
    ],
)
def test_gsm8k_strict_and_flexible(solution, ground_truth, strict, flexible):
    assert _gsm8k(solution, ground_truth, method="strict") == strict
    assert _gsm8k(solution, ground_truth, method="flexible") == flexible


def test_gsm8k_result_fields_and_format_score():
    fn = get_reward_fn("gsm8k")
    assert fn("gsm8k", "#### 72", "72") == {"score": 1.0, "acc": 1.0}
    assert fn("gsm8k", "#### 71", "72", format_score=0.1) == {"score": 0.1, "acc": 0.0}
    assert fn("gsm8k", "no answer", "72", format_score=0.1) == {"score": 0.0, "acc": 0.0}


def test_gsm8k_method_through_reward_kwargs():
    flexible = resolve_reward_fn("gsm8k", {"method": "flexible"})
    assert flexible("gsm8k", "it is 72", "72")["score"] == 1.0
    assert resolve_reward_fn("gsm8k")("gsm8k", "it is 72", "72")["score"] == 0.0
    with pytest.raises(UserError, match="unknown method 'loose'.*strict.*flexible"):
        resolve_reward_fn("gsm8k", {"method": "loose"})("gsm8k", "#### 1", "1")


def test_gsm8k_non_numeric_ground_truth_is_a_user_error():
    with pytest.raises(UserError, match="ground truth 'seventy' is not a number"):
        _gsm8k("#### 70", "seventy")


@pytest.mark.parametrize(
    "solution, ground_truth, expected",
    [
        ("So the answer is \\boxed{72}.", "72", 1.0),
        ("x = \\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\dfrac{1}{2}}", "0.5", 1.0),
        ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{\\sqrt2}{2}", 1.0),  # nested braces
        ("Factor: \\boxed{x(x+2)}", "x^2+2x", 1.0),
        ("\\boxed{3}", "2", 0.0),
        ("first \\boxed{3}, on reflection \\boxed{2}", "2", 1.0),  # the last box counts
        ("The answer is 72.", "72", 0.0),  # correct, but not boxed
    ],
)
def test_math_boxed_answers_with_math_verify(solution, ground_truth, expected):
    result = get_reward_fn("math")("lighteval/MATH", solution, ground_truth)
    assert result == {"score": expected, "acc": expected}


def test_math_reward_outside_the_main_thread():
    """math-verify's signal timeouts only work in the main thread; the reward still runs."""
    fn = get_reward_fn("math")
    with ThreadPoolExecutor(1) as pool:
        result = pool.submit(fn, "math", "\\boxed{\\frac{2}{4}}", "0.5").result()
    assert result["score"] == 1.0


def test_last_boxed_content():
    assert last_boxed_content("a \\boxed{1} b \\boxed{\\frac{1}{2}} c") == "\\frac{1}{2}"
    assert last_boxed_content("\\fbox{7}") == "7"
    assert last_boxed_content("\\boxed{unclosed") is None
    assert last_boxed_content("nothing") is None


@pytest.mark.parametrize(
    "solution, expected",
    [
        (" #### 7", 1.0),
        ("#### 7<|endoftext|>", 1.0),  # trailing text after the answer is ignored
        (" #### 7 Question: 1 + 1", 1.0),
        (" #### 70", 0.0),
        (" #### 7.5", 0.0),
        (" 7", 0.0),
        (" The sum is #### 7", 0.0),  # the answer must come first
    ],
)
def test_arith_strict_leading_answer(solution, expected):
    assert get_reward_fn("arith")("arith", solution, "7") == {"score": expected, "acc": expected}


@pytest.mark.parametrize(
    "data_source, right, wrong, ground_truth",
    [
        ("openai/gsm8k", "#### 1,250", "#### 1,251", "1250"),
        ("gsm8k", "#### 3", "#### 4", "3"),
        ("arith", " #### 12", " #### 21", "12"),
        ("lighteval/MATH", "\\boxed{\\frac12}", "\\boxed{\\frac13}", "\\frac{1}{2}"),
        ("HuggingFaceH4/MATH-500", "\\boxed{4}", "\\boxed{5}", "4"),
        ("aime2024", "\\boxed{204}", "\\boxed{240}", "204"),
    ],
)
def test_default_dispatch_by_data_source(data_source, right, wrong, ground_truth):
    assert default_compute_score(data_source, right, ground_truth)["score"] == 1.0
    assert default_compute_score(data_source, wrong, ground_truth)["score"] == 0.0


def test_default_unknown_data_source_is_a_clear_error():
    with pytest.raises(
        UserError, match="no builtin reward for data_source 'my/qa'.*module:function"
    ):
        default_compute_score("my/qa", "42", "42")
