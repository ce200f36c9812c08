"""The generative judge's text side: the grading prompt from a template, and the judge's reply
turned into a score (the engine that writes the reply is the rollout engine machinery).

    check_judge_template(template)                          UserError naming reward.judge.template
    prompt = render_judge_prompt(template, question=..., response=..., reference=...)
    parser = JudgeScoreParser(mode="number", min_score=0, max_score=10, default_score=0)
    result = parser.score_all(replies)   # JudgeScores: scores, failures, failed (indices)

Templates are Python format strings with the placeholders ``{question}`` (the prompt's text),
``{response}`` (the policy's response; required) and ``{reference}`` (the ground truth); write a
literal brace as ``{{`` or ``}}``.

Parsing: ``number`` mode takes the LAST match of ``pattern`` (default ``Score: N``; judges
reason first and conclude last) and accepts it within ``[min_score, max_score]``; ``verdict``
mode takes the last whole word (case-insensitive) that is a key of ``verdicts`` and maps it
(``incorrect`` is not read as ``correct``). A reply with no acceptable score gets
``default_score`` and is counted as a failure.
"""

from __future__ import annotations

import math
import re
import string
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from rlcli.errors import UserError

if TYPE_CHECKING:
    from rlcli.config.schema import JudgeConfig

JUDGE_TEMPLATE_KEY = "reward.judge.template"
PLACEHOLDERS = ("question", "response", "reference")
DEFAULT_SCORE_PATTERN = r"[Ss]core\s*[:=]\s*(-?\d+(?:\.\d+)?)"

DEFAULT_NUMBER_TEMPLATE = (
    "You are grading an answer to a question.\n\n"
    "Question:\n{question}\n\n"
    "Reference answer:\n{reference}\n\n"
    "Answer to grade:\n{response}\n\n"
    "How well does the answer to grade agree with the reference answer, from 0 (wrong) to 10 "
    "(fully correct)? Explain briefly, then end with one line 'Score: N'."
)
DEFAULT_VERDICT_TEMPLATE = (
    "You are grading an answer to a question.\n\n"
    "Question:\n{question}\n\n"
    "Reference answer:\n{reference}\n\n"
    "Answer to grade:\n{response}\n\n"
    "Is the answer to grade correct? Explain briefly, then end with one line "
    "'Verdict: correct' or 'Verdict: incorrect'."
)


def check_judge_template(template: str, key: str = JUDGE_TEMPLATE_KEY) -> None:
    """UserError naming `key` for a template that is not a format string of the placeholders,
    or that lacks ``{response}`` (the judge would never see what it grades)."""
    valid = ", ".join("{" + name + "}" for name in PLACEHOLDERS)
    try:
        parts = list(string.Formatter().parse(template))
    except ValueError as error:
        raise UserError(
            f"{key}: not a valid template ({error}); placeholders are {valid}, a literal brace "
            "is written {{ or }}"
        ) from None
    fields = [(name, conversion, spec) for _, name, spec, conversion in parts if name is not None]
    for name, conversion, spec in fields:
        if name not in PLACEHOLDERS or conversion or spec:
            shown = (
                "{"
                + name
                + (f"!{conversion}" if conversion else "")
                + (f":{spec}" if spec else "")
                + "}"
            )
            raise UserError(
                f"{key}: unknown placeholder {shown}; valid placeholders are {valid} (a literal "
                "brace is written {{ or }})"
            )
    if "response" not in {name for name, _, _ in fields}:
        raise UserError(
            f"{key} has no {{response}} placeholder: the judge would never see the response it "
            f"grades; valid placeholders are {valid}"
        )


def render_judge_prompt(template: str, *, question: str, response: str, reference: Any) -> str:
    """The judge's prompt for one sample (``reference``: the row's ground truth, as text)."""
    return template.format(question=question, response=response, reference=str(reference))


@dataclass(frozen=True)
class JudgeScores:
    """Scores of a batch of replies: ``failed`` are the indices that got the default."""

    scores: list[float]
    failed: list[int]

    @property
    def failures(self) -> int:
        return len(self.failed)


@dataclass(frozen=True)
class JudgeScoreParser:
    """A judge reply -> a score (module docstring). Construction checks the settings (UserError
    naming ``reward.judge.<field>``)."""

    mode: Literal["number", "verdict"] = "number"
    min_score: float = 0.0
    max_score: float = 10.0
    pattern: str = DEFAULT_SCORE_PATTERN
    verdicts: dict[str, float] = field(default_factory=lambda: {"correct": 1.0, "incorrect": 0.0})
    default_score: float = 0.0

    def __post_init__(self) -> None:
        if self.mode not in ("number", "verdict"):
            raise UserError(f"reward.judge.mode={self.mode!r}: choose number or verdict")
        if self.mode == "number":
            if not self.min_score < self.max_score:
                raise UserError(
                    f"reward.judge.min_score={self.min_score} must be below "
                    f"reward.judge.max_score={self.max_score}"
                )
            try:
                groups = re.compile(self.pattern).groups
            except re.error as error:
                raise UserError(f"reward.judge.pattern={self.pattern!r}: {error}") from None
            if groups != 1:
                raise UserError(
                    f"reward.judge.pattern={self.pattern!r} must have exactly one group (the "
                    f"number), it has {groups}"
                )
        elif not self.verdicts:
            raise UserError("reward.judge.verdicts is empty: map verdict words to scores")

    def parse(self, reply: str) -> float | None:
        """The score of one reply, or None when it has no acceptable one."""
        if self.mode == "number":
            matches = re.findall(self.pattern, reply)
            if not matches:
                return None
            value = float(matches[-1])
            if not math.isfinite(value) or not self.min_score <= value <= self.max_score:
                return None
            return value
        words = sorted(self.verdicts, key=len, reverse=True)  # longest first: "not correct"
        pattern = r"\b(" + "|".join(re.escape(word) for word in words) + r")\b"
        matches = re.findall(pattern, reply, flags=re.IGNORECASE)
        if not matches:
            return None
        lowered = {word.lower(): score for word, score in self.verdicts.items()}
        return float(lowered[matches[-1].lower()])

    def score_all(self, replies: list[str]) -> JudgeScores:
        scores, failed = [], []
        for index, reply in enumerate(replies):
            value = self.parse(reply)
            if value is None:
                failed.append(index)
                value = self.default_score
            scores.append(value)
        return JudgeScores(scores, failed)

    @classmethod
    def of(cls, section: JudgeConfig) -> JudgeScoreParser:
        """The parser of ``reward.judge.*`` (settings checked: UserError naming the key)."""
        return cls(
            mode=section.mode,
            min_score=section.min_score,
            max_score=section.max_score,
            pattern=section.pattern if section.pattern is not None else DEFAULT_SCORE_PATTERN,
            verdicts=dict(section.verdicts),
            default_score=section.default_score,
        )


def judge_template(section: JudgeConfig) -> str:
    """``reward.judge.template``, or the built-in one of ``reward.judge.mode``; checked
    (``check_judge_template``)."""
    default = DEFAULT_NUMBER_TEMPLATE if section.mode == "number" else DEFAULT_VERDICT_TEMPLATE
    template = section.template if section.template is not None else default
    check_judge_template(template)
    return template
