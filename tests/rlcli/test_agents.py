"""The agent endpoint (``rlcli.rollout.agents``) driven by agents written with the real ``openai`` SDK.

The engine is the HF engine over the model of ``multi_turn_model.py``, which writes back its
memorised 3-turn tool conversation; so an OpenAI-SDK agent offering ``tools=[calculator]`` makes
three real calls (a call the parser cannot read, a good call, the answer) through the endpoint.
Everything the run trains on is checked against an independent source: the chat template's
rendering of the whole conversation, and what the engine itself returned.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from openai import AuthenticationError, OpenAI

from rlcli.config.agentic import AgentOptions
from rlcli.data import PromptItem
from rlcli.errors import UserError
from rlcli.rewards import RewardManager, default_compute_score
from rlcli.rollout.agents.capture import CapturedCall, join_calls
from rlcli.rollout.agents.routes import start_endpoint
from rlcli.rollout.agents.runner import AgentRollout, load_agent
from rlcli.rollout.agents.server import AgentServer
from rlcli.rollout.base import SamplingConfig
from rlcli.rollout.sampling import score_samples, share_agent_scores
from tests.rlcli import openai_agents
from tests.rlcli.multi_turn_model import (
    ANSWER,
    BAD_CALL,
    GOOD_CALL,
    QUESTION,
    TOOLS,
    build_memorised_model,
    conversation,
)

SAMPLING = SamplingConfig(temperature=0.5, max_tokens=48, seed=5)


class RecordingEngine:
    """The real engine, keeping every completion it returned."""

    def __init__(self, engine) -> None:
        self.engine, self.returned, self.batches = engine, [], []

    def generate_requests(self, requests):
        self.batches.append(len(requests))
        results = self.engine.generate_requests(requests)
        self.returned += [c for completions in results for c in completions]
        return results

    def __getattr__(self, name):
        return getattr(self.engine, name)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_memorised_model(tmp_path_factory.mktemp("memorised") / "model")


@pytest.fixture(scope="module")
def model(model_dir):
    from transformers import AutoTokenizer

    from rlcli.rollout.hf_engine import HFEngine

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    server = AgentServer(tokenizer, "model.tokenizer_path", "policy", max_model_len=512)
    start_endpoint(server)
    yield tokenizer, HFEngine(str(model_dir)), server
    server.stop()


def _rollout(model, agent: str, **options) -> AgentRollout:
    tokenizer, _, server = model
    return AgentRollout(
        load_agent(f"tests.rlcli.openai_agents:{agent}"), AgentOptions(**options), tokenizer, server
    )


def _item(index: int) -> PromptItem:
    messages = [{"role": "user", "content": QUESTION}]
    return PromptItem(
        index, [0], "tool_multiply", "201954", {"index": index}, prompt_messages=messages
    )


def _run(model, agent: str, prompts: int = 1, n: int = 1, **options):
    openai_agents.RECEIVED.clear()
    engine = RecordingEngine(model[1])
    samples, stats = _rollout(model, agent, **options).run(
        engine, [(g, _item(g)) for g in range(prompts)], n, SAMPLING, 0
    )
    return samples, stats, engine


def _encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_tool_calling_agent_gives_one_sample_of_exactly_the_sampled_tokens(model):
    tokenizer = model[0]
    samples, stats, engine = _run(model, "calculator_agent")
    expected = conversation()
    assert stats.agents == 1 and stats.failed == 0 and stats.calls == 3 and stats.splits == 0
    assert len(samples) == 1
    sample = samples[0]
    # The prompt: the template's rendering of the question with the tools and generation prompt.
    render = tokenizer.apply_chat_template
    assert sample.prompt_ids == _encode(
        tokenizer, render(expected[:1], tools=TOOLS, tokenize=False, add_generation_prompt=True)
    )
    # The whole sample is the rendering of the memorised conversation (its last newline is never
    # generated), and the loss mask is 1 on exactly the tokens the engine returned, in order.
    whole = _encode(tokenizer, render(expected, tools=TOOLS, tokenize=False))
    assert sample.prompt_ids + sample.response_ids + _encode(tokenizer, "\n") == whole
    mask = torch.tensor(sample.loss_mask).bool()
    generated = torch.tensor(sample.response_ids)[mask].tolist()
    assert generated == [t for c in engine.returned for t in c.token_ids]
    engine_log_probs = [v for c in engine.returned for v in c.logprobs]
    assert torch.tensor(sample.engine_log_probs)[mask].tolist() == engine_log_probs
    assert (torch.tensor(sample.engine_log_probs)[~mask] == 0).all()
    # What the agent got back: the parser-unreadable call as content, then a real tool call
    # (tools= round trip), then the answer; per-token log-probs are the engine's.
    replies = openai_agents.RECEIVED[0]
    assert replies[0].choices[0].message.content == BAD_CALL
    assert replies[0].choices[0].finish_reason == "stop"
    call = replies[1].choices[0].message.tool_calls[0]
    assert call.function.name == "calculator"
    assert json.loads(call.function.arguments) == {"expression": "347 * 582"}
    assert replies[1].choices[0].finish_reason == "tool_calls"
    assert replies[2].choices[0].message.content == ANSWER
    client_log_probs = [t.logprob for r in replies for t in r.choices[0].logprobs.content]
    assert client_log_probs == pytest.approx(engine_log_probs, abs=1e-6)
    assert stats.reused_prompts == 2 and stats.rendered_prompts == 1
    # Scored by the run's reward function on the whole trajectory.
    record = sample.trajectory
    assert record.solution_str == BAD_CALL + GOOD_CALL + ANSWER
    assert record.agent.reward is None and record.assistant_turns == 3
    manager = RewardManager(default_compute_score, in_process=True)
    score_samples(samples, manager, tokenizer)
    manager.close()
    assert sample.score == 1.0


def test_a_streaming_agent_reads_what_a_plain_one_reads_and_trains_the_same_tokens(model):
    """``stream=true``: the OpenAI client reassembles the same replies from the events (content,
    tool-call deltas, finish reasons, log-probs, the usage chunk), and the run captures the same
    sample as without streaming."""
    plain, _, _ = _run(model, "calculator_agent")
    samples, stats, engine = _run(model, "streaming_calculator_agent")
    assert stats.agents == 1 and stats.failed == 0 and stats.calls == 3 and stats.splits == 0
    assert samples[0].prompt_ids == plain[0].prompt_ids
    assert samples[0].response_ids == plain[0].response_ids
    assert samples[0].loss_mask == plain[0].loss_mask
    replies = openai_agents.RECEIVED[0]
    assert [r[0] for r in replies] == [BAD_CALL, None, ANSWER]
    assert [r[2] for r in replies] == ["stop", "tool_calls", "stop"]
    (call,) = replies[1][1]
    assert call["name"] == "calculator"
    assert json.loads(call["args"]) == {"expression": "347 * 582"}
    for reply, returned in zip(replies, engine.returned, strict=True):
        assert reply[3] == pytest.approx(returned.logprobs, abs=1e-6)
        assert reply[4].completion_tokens == len(returned.token_ids)
    samples, stats, _ = _run(model, "streaming_text_agent", prompts=2)
    assert stats.failed == 0
    for sample in samples:
        text, finish = openai_agents.RECEIVED[sample.group][0]
        assert text == sample.trajectory.solution_str and finish in ("stop", "length")


def test_an_agent_that_edits_its_history_gives_two_samples_and_a_counted_split(model):
    tokenizer = model[0]
    samples, stats, engine = _run(model, "editing_agent", prompts=2)
    assert stats.agents == 2 and stats.splits == 2 and stats.split_trajectories == 2
    assert stats.metrics()["agent/split_rate"] == 1.0
    assert [s.group for s in samples] == [0, 0, 1, 1]
    for first, second in zip(samples[::2], samples[1::2], strict=True):
        assert first.trajectory.agent.session == second.trajectory.agent.session
        assert [first.trajectory.agent.segment, second.trajectory.agent.segment] == [0, 1]
        for sample in (first, second):  # each segment: one call, all of it sampled
            assert sample.loss_mask == [1] * len(sample.response_ids)
        # The second prompt is the edited history rendered by the template, not a re-use.
        assert "(summarised)" in tokenizer.decode(second.prompt_ids)
    assert sum(len(s.response_ids) for s in samples) == sum(
        len(c.token_ids) for c in engine.returned
    )
    share_agent_scores(samples)
    assert [s.score for s in samples] == [1.0] * 4


def test_concurrent_agents_do_not_mix_their_calls(model):
    tokenizer = model[0]
    samples, stats, engine = _run(model, "numbered_agent", prompts=16, n=4, concurrency=64)
    assert stats.agents == 64 and stats.failed == 0 and len(samples) == 64
    assert max(engine.batches) > 1  # the calls were batched, not answered one by one
    for sample in samples:
        index = sample.group
        assert f"row {index}" in tokenizer.decode(sample.prompt_ids)
        assert sample.trajectory.agent.reward == float(index)
    for index in range(16):
        got = sorted(openai_agents.RECEIVED[index])
        mine = sorted(s.trajectory.solution_str for s in samples if s.group == index)
        assert got == mine


def test_async_agents_and_the_completions_route(model):
    samples, stats, _ = _run(model, "async_numbered_agent", prompts=3, n=2)
    assert stats.agents == 6 and stats.failed == 0
    assert sorted(s.trajectory.agent.reward for s in samples) == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0]
    for sample in samples:
        assert model[0].decode(sample.prompt_ids) == f"row {sample.group}"


def test_failing_agents_are_counted_not_fatal(model):
    samples, stats, _ = _run(model, "failing_agent", prompts=4)
    assert stats.failed == 4 and stats.errors == 4 and stats.unknown_model == 2
    assert "agent bug on row" in stats.first_error or "gpt-4o" in stats.first_error
    assert samples == [] and stats.dropped_samples == 2  # the odd rows' one call each
    samples, stats, _ = _run(model, "failing_agent", prompts=4, on_failure="zero")
    assert len(samples) == 2 and all(s.trajectory.agent.reward == 0.0 for s in samples)
    with pytest.raises(UserError, match="4 of 4 agents failed.*max_failure_rate=0.5"):
        stats.check(0.5)
    samples, stats, _ = _run(model, "wrong_return_agent", prompts=2)
    assert stats.bad_returns == 2 and "returned str 'correct'" in stats.first_error


@pytest.mark.parametrize("agent", ["slow_agent", "slow_async_agent"])
def test_an_agent_past_its_timeout_is_counted(model, agent):
    _, stats, _ = _run(model, agent, prompts=2, timeout_s=0.5)
    assert stats.timeouts == 2 and "timeout_s=0.5" in stats.first_error


def test_top_logprobs_are_refused_not_left_empty(model):
    samples, stats, _ = _run(model, "top_logprobs_agent")
    assert stats.failed == 0 and stats.bad_requests == 1 and len(samples) == 1
    (message,) = openai_agents.RECEIVED[0]
    assert "top_logprobs is not served" in message


def test_the_endpoint_wants_the_run_key_and_a_session(model):
    _, _, server = model
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=server.base_url(), api_key="wrong", max_retries=0).models.list()
    client = OpenAI(base_url=server.base_url(), api_key=server.api_key, max_retries=0)
    with pytest.raises(Exception, match="use the base_url your agent was given"):
        client.models.list()


def test_join_calls_by_hand():
    a = CapturedCall([1, 2], [3, 4], [-0.1, -0.2], "stop")
    b = CapturedCall([1, 2, 3, 4, 5], [6], [-0.3], "stop")  # extends a
    c = CapturedCall([1, 9], [7], [-0.4], "length")  # does not
    d = CapturedCall([1, 2, 3, 4, 5, 6, 8], [9], [-0.5], "stop")  # extends a + b
    first, second = join_calls([a, b, c, d])
    assert first.prompt_ids == [1, 2] and first.response_ids == [3, 4, 5, 6, 8, 9]
    assert first.loss_mask == [1, 1, 0, 1, 0, 1]
    assert first.log_probs == [-0.1, -0.2, 0.0, -0.3, 0.0, -0.5]
    assert first.calls == 3
    assert second.prompt_ids == [1, 9] and second.loss_mask == [1]
    assert second.finish_reason == "length"


def test_an_agent_spec_that_is_not_a_function_is_a_user_error():
    with pytest.raises(UserError, match="rollout.agent: agent 'tests.rlcli.nowhere:f'"):
        load_agent("tests.rlcli.nowhere:f")
    with pytest.raises(UserError, match="is not callable"):
        load_agent("tests.rlcli.openai_agents:NOT_AN_AGENT")


AGENT = "rollout.agent=tests.rlcli.openai_agents:calculator_agent"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout.agent=tests.rlcli.nowhere:agent"], "rollout.agent: agent"),
        (["rollout.agent=tests.rlcli.openai_agents:NOT_AN_AGENT"], "is not callable"),
        ([AGENT, "rollout.multi_turn.tool_config=tools.yaml"], "cannot be combined with"),
        ([AGENT, "rollout.agent_options.concurrency=0"], "rollout.agent_options.concurrency"),
        ([AGENT, "rollout.agent_options.timeout_s=0"], "rollout.agent_options.timeout_s"),
        ([AGENT, "rollout.agent_options.max_failure_rate=2"], "max_failure_rate must be in"),
        ([AGENT, "data.apply_chat_template=false"], "data.apply_chat_template"),
        ([AGENT, "rollout.max_model_len=64"], "rollout.agent_options.max_response_tokens"),
    ],
)
def test_bad_agent_settings_name_the_key(overrides, message):
    from rlcli.validation.loader import load_config
    from tests.rlcli.test_config import QUICKSTART

    with pytest.raises(UserError, match=re.escape(message)):
        load_config(QUICKSTART, overrides)


def test_the_cli_refuses_an_agent_that_does_not_import_with_exit_2():
    from tests.rlcli.test_config import QUICKSTART, run_cli

    proc = run_cli("config", "validate", str(QUICKSTART), "rollout.agent=nowhere_at_all:agent")
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "rollout.agent" in proc.stderr and "Traceback" not in proc.stderr


def test_the_agent_quickstart_recipe_loads(monkeypatch):
    from rlcli.validation.loader import load_config
    from tests.rlcli.test_config import REPO

    monkeypatch.chdir(REPO)  # the recipe names the example agent by a path from the repository
    cfg = load_config(REPO / "recipes" / "agent_quickstart.yaml")
    assert cfg.rollout.agent == "examples/agents/calculator_agent.py:agent"
    assert not cfg.rollout.multi_turn.enable
