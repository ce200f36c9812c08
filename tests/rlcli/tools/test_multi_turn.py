"""``build_multi_turn``: everything built from ``rollout.multi_turn`` reads its settings, and the
pieces fit together (a turn's text -> calls -> outcomes -> appended ids)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rlcli.config.agentic import MultiTurnConfig
from rlcli.errors import UserError
from rlcli.model.builder import train_tokenizer
from rlcli.tools.multi_turn import TurnBudget, build_multi_turn
from rlcli.tools.rendering import TRUNCATED
from rlcli.validation.loader import load_config
from tests.rlcli.tools.chat_tokenizer import build_chat_tokenizer

USER_TOOLS = Path(__file__).with_name("user_tools.py")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_chat_tokenizer(tmp_path_factory.mktemp("qwen"), "qwen")


def _tool_config(tmp_path: Path, tools) -> str:
    path = tmp_path / "tools.yaml"
    path.write_text(yaml.safe_dump({"tools": tools}))
    return str(path)


def test_disabled_builds_nothing(tokenizer):
    assert build_multi_turn(MultiTurnConfig(), tokenizer) is None


def test_a_turn_from_text_to_appended_ids(tmp_path, tokenizer):
    config = MultiTurnConfig(
        enable=True,
        tool_config=_tool_config(tmp_path, ["calculator"]),
        max_tool_calls_per_turn=2,
        max_tool_response_tokens=12,
        tool_response_truncate_side="right",
    )
    parts = build_multi_turn(config, tokenizer)
    text = '<tool_call>{"name": "calculator", "arguments": {"expression": "2**200"}}</tool_call>'
    parsed = parts.parse_tool_calls(text)
    trajectory = parts.tools.for_trajectory({})
    [outcomes] = parts.runner.run_turn([(trajectory, parsed.calls)])
    assert outcomes[0].text == str(2**200)
    generated = tokenizer(text, add_special_tokens=False)["input_ids"]
    generated += [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    ids = parts.renderer.append_ids(generated, parts.tool_messages(outcomes))
    cut = parts.renderer.truncate(str(2**200), 12, "right")
    assert cut.endswith(TRUNCATED)
    expected = parts.renderer.append_ids(generated, [{"role": "tool", "content": cut}])
    assert ids == expected
    assert tokenizer.decode(ids).startswith("\n<|im_start|>user\n<tool_response>\n")
    # The tool schemas reach the prompt's system message.
    assert '"name": "calculator"' in tokenizer.decode(
        parts.renderer.prompt_ids([{"role": "user", "content": "x"}])
    )
    parts.close()


def test_environment_and_budget(tokenizer):
    config = MultiTurnConfig(enable=True, environment="running_sum", max_assistant_turns=3)
    parts = build_multi_turn(config, tokenizer)
    assert parts.tools is None and parts.runner is None
    state = parts.environment.start({"numbers": [1, 2, 3]})
    response = parts.environment.respond(state, " #### 3")
    ids = parts.renderer.append_ids([1, 2], [{"role": "user", "content": response.text}])
    assert tokenizer.decode(ids).endswith(
        "Question: 3 + 3 = ? Answer:<|im_end|>\n<|im_start|>assistant\n"
    )
    budget = parts.budget
    assert budget == TurnBudget(max_assistant_turns=3, max_response_tokens=1024)
    assert budget.may_continue(2, 100) and not budget.may_continue(3, 100)
    assert not budget.may_continue(1, 1024)
    assert budget.generation_limit(1000, max_tokens=64) == 24
    assert budget.generation_limit(10, max_tokens=64) == 64


def test_errors_name_the_setting(tmp_path, tokenizer):
    plain = train_tokenizer(["text 123"] * 4, vocab_size=300)
    config = MultiTurnConfig(enable=True, environment="running_sum")
    with pytest.raises(UserError, match="the tokenizer of model.path has none"):
        build_multi_turn(config, plain, tokenizer_setting="model.path")
    slow_python = _tool_config(tmp_path, [{"class": "python", "config": {"wall_time_s": 40}}])
    import shutil

    if shutil.which("bwrap"):
        with pytest.raises(
            UserError, match="up to 41 s, not less than rollout.multi_turn.tool_timeout_s=30"
        ):
            build_multi_turn(MultiTurnConfig(enable=True, tool_config=slow_python), tokenizer)


def _recipe(tmp_path: Path, **multi_turn) -> list[str]:
    overrides = ["model.path=m", "rollout.multi_turn.enable=true"]
    return overrides + [f"rollout.multi_turn.{k}={v}" for k, v in multi_turn.items()]


def test_config_validation_checks_the_tool_config(tmp_path):
    good = _tool_config(tmp_path, ["calculator"])
    cfg = load_config(None, _recipe(tmp_path, tool_config=good))
    assert cfg.rollout.multi_turn.tool_config == str(good)
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"tools": [{"class": f"{USER_TOOLS}:NotATool"}]}))
    with pytest.raises(UserError, match=f"{bad}: tools\\[0\\]: .*is not a tool class"):
        load_config(None, _recipe(tmp_path, tool_config=bad))
    with pytest.raises(UserError, match="needs tools \\(rollout.multi_turn.tool_config=FILE\\)"):
        load_config(None, _recipe(tmp_path))
    with pytest.raises(
        UserError, match="rollout.multi_turn.environment='nope': unknown environment; valid names"
    ):
        load_config(None, _recipe(tmp_path, environment="nope"))
    with pytest.raises(
        UserError, match="tool_response_truncate_side=.up. is not valid; choose one of"
    ):
        load_config(None, _recipe(tmp_path, tool_config=good, tool_response_truncate_side="up"))
    with pytest.raises(UserError, match="rollout.multi_turn.max_tool_calls_per_turn must be >= 1"):
        load_config(None, _recipe(tmp_path, tool_config=good, max_tool_calls_per_turn=0))
    # Disabled: nothing is checked (the default config has no tools).
    load_config(None, ["model.path=m", f"rollout.multi_turn.tool_config={bad}"])
