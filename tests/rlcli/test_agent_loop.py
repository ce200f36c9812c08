"""The multi-turn rollout loop (``rlcli.rollout.agent_loop``) driven by real engines and real tools.

A tiny model that memorised one 3-turn tool conversation (``multi_turn_model.py``: a malformed
call, the parser's error text, a good call, the calculator's answer, the final answer) writes it
back, so each test runs the loop through real turns: token ids against the chat template's
rendering of the whole conversation, the loss mask against the assistant spans found in that
rendering, log-probs, budgets, seeds, rewards and metrics.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlcli.config.agentic import MultiTurnConfig
from rlcli.data import PromptItem
from rlcli.rewards import RewardManager, default_compute_score
from rlcli.rollout.agent_loop import AgentLoop, multi_turn_metrics, turn_seed
from rlcli.rollout.base import SamplingConfig
from rlcli.rollout.sampling import score_samples
from rlcli.tools.multi_turn import build_multi_turn
from rlcli.tools.rendering import TRUNCATED
from tests.rlcli.counting_engine import CountingEngine
from tests.rlcli.multi_turn_model import (
    ANSWER,
    BAD_CALL,
    GOOD_CALL,
    QUESTION,
    TOOLS,
    build_memorised_model,
    conversation,
    write_tool_config,
)

REPO = Path(__file__).resolve().parents[2]
SAMPLING = SamplingConfig(temperature=0.5, max_tokens=48, seed=5)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from transformers import AutoTokenizer

    from rlcli.rollout.hf_engine import HFEngine

    root = tmp_path_factory.mktemp("memorised")
    model_dir = build_memorised_model(root / "model")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return model_dir, tokenizer, HFEngine(str(model_dir)), write_tool_config(root / "tools.json")


def _loop(model, **settings) -> AgentLoop:
    _, tokenizer, _, tools = model
    config = MultiTurnConfig(enable=True, tool_config=str(tools), **settings)
    return AgentLoop(build_multi_turn(config, tokenizer), tokenizer)


def _item(loop: AgentLoop) -> PromptItem:
    messages = [{"role": "user", "content": QUESTION}]
    prompt = loop.components.renderer.prompt_ids(messages)
    extra = {"tools_kwargs": {"calculator": {"create_kwargs": {}}}, "index": 0}
    return PromptItem(0, prompt, "tool_multiply", "201954", extra, prompt_messages=messages)


def _run(model, n=2, sampling=SAMPLING, **settings):
    loop = _loop(model, **settings)
    samples = loop.run(model[2], [(0, _item(loop)), (1, _item(loop))], n, sampling, 0)
    loop.close()
    return samples


def _encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _rendering(tokenizer, messages, **kwargs):
    return _encode(
        tokenizer, tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False, **kwargs)
    )


def test_trajectory_is_the_rendering_of_its_turns_and_the_mask_covers_the_generated_tokens(
    model,
):
    _, tokenizer, _, _ = model
    expected = conversation()
    whole = _rendering(tokenizer, expected)
    # The assistant spans, found in the template's rendering alone: each turn starts where the
    # rendering of the conversation before it (with the generation prompt) ends, and is its
    # content's tokens and <|im_end|>.
    mask = [0] * len(whole)
    for position, message in enumerate(expected):
        if message["role"] == "assistant":
            start = len(_rendering(tokenizer, expected[:position], add_generation_prompt=True))
            span = len(_encode(tokenizer, message["content"])) + 1
            assert whole[start + span - 1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
            mask[start : start + span] = [1] * span
    samples = _run(model)
    assert len(samples) == 4 and [s.group for s in samples] == [0, 0, 1, 1]
    for sample in samples:
        ids = sample.prompt_ids + sample.response_ids
        prompt_len = len(sample.prompt_ids)
        # The whole rendering ends with the newline after the last <|im_end|>, never generated.
        assert ids + _encode(tokenizer, "\n") == whole
        assert sample.loss_mask == mask[prompt_len : len(ids)]
        # Log-probs for generated tokens only (their values: test_engine_log_probs_are_the_models).
        log_probs = torch.tensor(sample.engine_log_probs)
        assert len(log_probs) == len(sample.response_ids)
        assert (log_probs[~torch.tensor(sample.loss_mask).bool()] == 0).all()
        record = sample.trajectory
        assert record.assistant_turns == 3 and sample.finish_reason == "stop"
        assert [c.status for c in record.tool_calls] == ["error", "ok"]
        assert record.tool_calls[0].text.startswith("Error: tool call 1 is not valid JSON")
        assert record.tool_calls[1].text == "201954"
        assert record.solution_str == BAD_CALL + GOOD_CALL + ANSWER
        assert [m["content"] for m in record.messages] == [m["content"] for m in expected]
        assert record.cut_by is None


def test_engine_log_probs_are_the_models(model):
    """The HF engine's sampled-token log-probs against a plain forward of the whole trajectory."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(model[0], dtype=torch.float32).eval()
    for sample in _run(model, n=1):
        ids = torch.tensor([sample.prompt_ids + sample.response_ids])
        with torch.no_grad():
            log_probs = (reference(ids).logits[0, :-1] / SAMPLING.temperature).log_softmax(-1)
        start = len(sample.prompt_ids) - 1
        picked = log_probs[start:].gather(-1, ids[0, start + 1 :, None])[:, 0]
        generated = torch.tensor(sample.loss_mask).bool()
        engine = torch.tensor(sample.engine_log_probs)
        assert (picked[generated] - engine[generated]).abs().max() < 1e-4


def test_budgets_cut_trajectories(model):
    tokenizer = model[1]
    for sample in _run(model, max_assistant_turns=2):
        record = sample.trajectory
        assert record.assistant_turns == 2 and record.cut_by == "max_assistant_turns"
        assert len(record.tool_calls) == 1  # the second turn's call never runs
        assert sample.finish_reason == "length"
        assert sample.response_ids[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    # Room for the first turn and its error text, not for the second turn's full call.
    first = len(_encode(tokenizer, BAD_CALL)) + 1
    budget = first + 40
    for sample in _run(model, max_response_tokens=budget):
        assert sample.trajectory.cut_by == "max_response_tokens"
        assert len(sample.response_ids) <= budget
    # A long tool response is cut (here the parser's error text, keeping its start).
    for sample in _run(
        model, n=1, max_tool_response_tokens=24, tool_response_truncate_side="right"
    ):
        shown = sample.trajectory.messages[2]["content"]
        assert shown.startswith("Error: ") and shown.endswith(TRUNCATED)


def test_sampling_is_reproducible_and_seeded_per_turn(model):
    first = _run(model)
    again = _run(model)
    assert [s.response_ids for s in first] == [s.response_ids for s in again]
    assert [s.engine_log_probs for s in first] == [s.engine_log_probs for s in again]
    seeds = {
        turn_seed(step, replica, trajectory, turn)
        for step in (1, 2)
        for replica in (0, 1)
        for trajectory in range(4)
        for turn in range(3)
    }
    assert len(seeds) == 2 * 2 * 4 * 3
    assert all(0 <= s < 2**31 for s in seeds)


def test_the_reward_sees_the_whole_trajectory(model):
    seen = []

    def reward(data_source, solution_str, ground_truth, extra_info=None):
        seen.append((solution_str, extra_info))
        return default_compute_score(data_source, solution_str, ground_truth, extra_info)

    samples = _run(model, n=1)
    manager = RewardManager(reward, in_process=True)
    score_samples(samples, manager, model[1])
    manager.close()
    assert [s.score for s in samples] == [1.0, 1.0]  # "#### 201954" after the last ####
    solution, extra = seen[0]
    assert solution == BAD_CALL + GOOD_CALL + ANSWER
    assert extra["num_turns"] == 3 and extra["num_tool_calls"] == 2
    assert extra["tool_rewards"] == [] and extra["cut_by"] is None
    assert extra["messages"][-1] == {"role": "assistant", "content": ANSWER}
    assert extra["tools_kwargs"] == {"calculator": {"create_kwargs": {}}}  # the row's own


def test_metrics_of_a_step(model):
    samples = _run(model)
    metrics = multi_turn_metrics(samples, prefix="val/")
    response = sum(len(s.response_ids) for s in samples)
    generated = sum(sum(s.loss_mask) for s in samples)
    assert metrics["val/multi_turn/turns_mean"] == 3.0
    assert metrics["val/multi_turn/tool_calls_mean"] == 2.0
    assert metrics["val/multi_turn/tool_call_rate"] == 1.0
    assert metrics["val/multi_turn/budget_cut_rate"] == 0.0
    assert metrics["val/multi_turn/masked_token_ratio"] == pytest.approx(1 - generated / response)
    assert metrics["val/tool/calls"] == 8.0 and metrics["val/tool/error_rate"] == 0.5
    assert metrics["val/tool/timeout_rate"] == 0.0 and metrics["val/tool/latency_max_s"] > 0


def test_an_environment_answers_turns_without_tool_calls(model):
    _, tokenizer, engine, _ = model
    config = MultiTurnConfig(
        enable=True,
        environment="tests.rlcli.tools.user_environments:EchoEnvironment",
        environment_kwargs={"turns": 2},
        max_assistant_turns=5,
    )
    loop = AgentLoop(build_multi_turn(config, tokenizer), tokenizer)
    messages = [{"role": "user", "content": QUESTION}]
    prompt = loop.components.renderer.prompt_ids(messages)
    item = PromptItem(0, prompt, "x", "1", {}, prompt_messages=messages)
    [sample] = loop.run(engine, [(0, item)], 1, SAMPLING, 0)
    record = sample.trajectory
    assert record.assistant_turns == 3 and record.environment_reward == 1.0
    assert [m["role"] for m in record.messages] == ["user"] + ["assistant", "user"] * 2 + [
        "assistant"
    ]
    assert record.messages[2]["content"] == f"you said: {record.messages[1]['content']}"
    # Each environment message is appended as the renderer renders it alone.
    renderer = loop.components.renderer
    end_of_turn = sample.response_ids.index(renderer.end_of_turn_id) + 1
    first_turn = sample.response_ids[:end_of_turn]
    appended = renderer.append_ids(first_turn, [record.messages[2]])
    start = len(first_turn)
    assert sample.response_ids[start : start + len(appended)] == appended
    assert sample.loss_mask[start : start + len(appended)] == [0] * len(appended)


@pytest.mark.vllm
def test_trainer_log_probs_and_critic_values_on_three_turn_trajectories(model, tmp_path):
    """Megatron's log-probs of the generated tokens equal the vLLM and HF engines' (fp32, the
    single-turn tolerance), tool tokens have none; PPO's critic gives values on generated tokens
    only and GAE skips the tool tokens."""
    out = tmp_path / "out.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).with_name("agent_loop_worker.py")),
            str(model[0]),
            str(model[3]),
            str(out),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    results = json.loads(out.read_text())
    for engine in ("vllm", "hf"):
        got = results[engine]
        assert got["max_diff"] < 1e-3, (engine, got)
        assert max(got["turns"]) == 3 and got["masked_tokens"] > 0, (engine, got)
        assert got["masked_log_probs_zero"], (engine, got)
    critic = results["critic"]
    assert critic["values_zero_off_generated"] and critic["values_nonzero_on_generated"]
    assert critic["advantages_zero_off_generated"] and critic["gae_max_diff"] < 1e-5, critic


def test_dapo_dynamic_sampling_draws_again_through_the_agent_loop(model):
    """DAPO's extra rounds each run the whole multi-turn loop, all inside the step's one awake
    block. The memorised model answers every sample alike, so no group's reward varies (the first
    prompt always right, the second graded against a wrong ground truth): every round is drawn,
    nothing is kept, and the step's multi-turn metrics are those of its first round."""
    from rlcli.rollout.agent_loop import build_agent_loop
    from rlcli.rollout.dynamic_sampling import keep_informative_groups
    from rlcli.rollout.sampling import Sampler
    from rlcli.run.metrics import Timer
    from rlcli.validation.loader import load_config

    model_dir, tokenizer, engine, tools = model
    cfg = load_config(None, [
        f"model.path={model_dir}", "data.train_batch_size=2", "rollout.n=2",
        "rollout.temperature=0.5", "rollout.max_tokens=48", "rollout.multi_turn.enable=true",
        f"rollout.multi_turn.tool_config={tools}", "rollout.multi_turn.max_response_tokens=256",
        "algorithm.dynamic_sampling.enabled=true", "algorithm.dynamic_sampling.max_gen_batches=3",
    ])  # fmt: skip
    loop = _loop(model)
    right = _item(loop)
    wrong = PromptItem(1, right.prompt_token_ids, "tool_multiply", "0", right.extra_info,
                       prompt_messages=right.prompt_messages)  # fmt: skip
    loop.close()
    counting = CountingEngine(engine)
    rewards = RewardManager(default_compute_score, in_process=True)
    agent = build_agent_loop(cfg.rollout.multi_turn, tokenizer, "model.path", rollout_tp=1)
    sampler = Sampler(cfg, counting, rewards, tokenizer, agent)
    samples, metrics = sampler.collect(iter([[right, wrong]] * 3), 1, Timer())
    rewards.close()
    agent.close()
    # 3 rounds x 3 turns, each turn one batched call over the 4 live trajectories
    assert counting.calls == ["wake_up", *["generate(4)"] * 9, "sleep"]
    assert len(samples) == 3 * 2 * 2 and metrics["dapo/gen_batches"] == 3
    kept, kept_metrics = keep_informative_groups(
        samples, cfg.algorithm.dynamic_sampling, cfg.data.train_batch_size
    )
    assert kept == [] and kept_metrics["dapo/kept_groups_ratio"] == 0
    assert metrics["multi_turn/turns_mean"] == 3.0 and metrics["tool/calls"] == 8.0
    assert metrics["reward/accuracy"] == 0.5
