"""rlcli.model.heads: what a head cannot do is said once, by the base class."""

from __future__ import annotations

import pytest

from rlcli.model.heads import LanguageModelHead, ScoreHead, ValueHead


def test_a_head_without_a_pass_says_so():
    with pytest.raises(TypeError, match="ScoreHead has no per-token outputs"):
        ScoreHead().forward(None, None, 1.0)
    for head in (LanguageModelHead(), ValueHead()):
        with pytest.raises(TypeError, match="score\\(\\) needs a reward model"):
            head.score(None, None, None)
