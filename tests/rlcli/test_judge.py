"""The generative judge's text side: templates checked (errors name reward.judge.template) and
rendered, replies parsed into scores with failures counted and the default applied."""

from __future__ import annotations

import pytest

from rlcli.errors import UserError
from rlcli.rewards.judge import (
    DEFAULT_NUMBER_TEMPLATE,
    DEFAULT_VERDICT_TEMPLATE,
    JudgeScoreParser,
    check_judge_template,
    render_judge_prompt,
)


@pytest.mark.parametrize("template", [DEFAULT_NUMBER_TEMPLATE, DEFAULT_VERDICT_TEMPLATE])
def test_default_templates_render_the_three_fields(template):
    check_judge_template(template)
    prompt = render_judge_prompt(template, question="2 + 3?", response="It is 5.", reference=5)
    assert "2 + 3?" in prompt and "It is 5." in prompt and "\n5\n" in prompt


def test_literal_braces_survive():
    template = 'Reply as JSON {{"score": N}}. Answer: {response}'
    check_judge_template(template)
    assert render_judge_prompt(template, question="", response="x", reference="") == (
        'Reply as JSON {"score": N}. Answer: x'
    )


@pytest.mark.parametrize(
    ("template", "needles"),
    [
        ("Question: {question} Reference: {reference}", ["no {response} placeholder"]),
        ("{response} {answer}", ["unknown placeholder {answer}"]),
        ("{response} {}", ["unknown placeholder {}"]),
        ("{response:>10}", ["unknown placeholder {response:>10}"]),
        ("{response} {", ["not a valid template"]),
    ],
)
def test_bad_templates_name_the_key(template, needles):
    with pytest.raises(UserError) as caught:
        check_judge_template(template)
    message = str(caught.value)
    assert message.startswith("reward.judge.template"), message
    for needle in needles:
        assert needle in message, message


def test_number_replies_and_garbage():
    parser = JudgeScoreParser(mode="number", min_score=0, max_score=10, default_score=-1.0)
    replies = [
        "The answer matches the reference.\nScore: 9",  # as the template asks
        "Score: 2 at first sight, but on reflection... Score: 7",  # the last one counts
        "score = 3.5 out of 10",
        "Score: 11",  # out of range
        "I cannot grade this.",  # no score at all
        "",
        "Score: -0",
    ]
    result = parser.score_all(replies)
    assert result.scores == [9.0, 7.0, 3.5, -1.0, -1.0, -1.0, 0.0]
    assert result.failed == [3, 4, 5] and result.failures == 3


def test_verdict_replies_and_garbage():
    parser = JudgeScoreParser(
        mode="verdict", verdicts={"correct": 1.0, "incorrect": 0.0}, default_score=0.25
    )
    replies = [
        "The sum is right.\nVerdict: correct",
        "Verdict: incorrect",
        "It looked CORRECT, but it is Incorrect.",  # the last verdict word, any case
        "The reasoning is incorrectly argued",  # no whole verdict word
        "Verdict: maybe",
    ]
    result = parser.score_all(replies)
    assert result.scores == [1.0, 0.0, 0.0, 0.25, 0.25]
    assert result.failed == [3, 4]


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({"min_score": 5, "max_score": 5}, "reward.judge.min_score"),
        ({"pattern": "Score: \\d+"}, "reward.judge.pattern"),
        ({"pattern": "Score: ("}, "reward.judge.pattern"),
        ({"mode": "verdict", "verdicts": {}}, "reward.judge.verdicts"),
        ({"mode": "stars"}, "reward.judge.mode"),
    ],
)
def test_bad_parser_settings_name_the_key(options, key):
    with pytest.raises(UserError, match=key.replace(".", r"\.")):
        JudgeScoreParser(**options)
