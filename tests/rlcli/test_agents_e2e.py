"""Agents written against the OpenAI API, end to end: ``rlcli train`` under torchrun with the
calculator agent (DP2, one vLLM engine over both ranks), agents on rollout ranks of their own, and
``rlcli serve`` started as a user starts it. The endpoint's parts are tested in ``test_agents.py``.
"""

from __future__ import annotations

import pytest
from openai import OpenAI

from tests.rlcli.multi_turn_model import BAD_CALL, QUESTION, TOOLS, build_memorised_model

AGENT = "rollout.agent=tests.rlcli.openai_agents:calculator_agent"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_memorised_model(tmp_path_factory.mktemp("memorised") / "model")


@pytest.mark.dist
@pytest.mark.vllm
def test_grpo_with_an_openai_agent_dp2_rollout_tp2(model_dir, tmp_path):
    """``rlcli train`` under torchrun: training DP2, one vLLM engine over both ranks (the
    replica's leader runs the endpoint and the agents, the other rank follows its engine calls),
    the calculator agent making its three calls per trajectory, held-out before and after."""
    from tests.rlcli.test_multi_turn_e2e import memorised_run
    from tests.rlcli.test_train_e2e import records, train

    out = tmp_path / "run"
    train(
        out,
        *memorised_run(model_dir, tmp_path),
        AGENT,
        "rollout.agent_options.max_response_tokens=256",  # the conversation: 192 tokens
    )
    steps = records(out)
    assert [r["step"] for r in steps] == [0, 1, 2]
    for record in steps[1:]:
        assert record["agent/count"] == 16, record  # 4 prompts x 4 samples
        assert record["agent/calls_mean"] == 3.0, record
        assert record["agent/failure_rate"] == 0.0 and record["agent/split_rate"] == 0.0
        assert record["agent/reused_prompt_rate"] == pytest.approx(2 / 3)
        assert record["reward/accuracy"] == 1.0, record
        assert record["rollout/logprob_diff_max"] < 1e-3, record["rollout/logprob_diff_max"]
        assert 0 < record["multi_turn/masked_token_ratio"] < 1
    for record in (steps[0], steps[-1]):
        assert record["val/reward/accuracy"] == 1.0 and record["val/agent/calls_mean"] == 3.0


def test_rlcli_serve_answers_the_openai_client(model_dir):
    """``rlcli serve`` as a user starts it: a process, the HF engine, a key of the user's; the
    chat route with tools and the completions route, then Ctrl-C (SIGINT), which stops it even
    when it was started with SIGINT ignored (this is how the full suites once saw it outlive
    Ctrl-C: an earlier test had left SIGINT ignored in the pytest worker it inherited from)."""
    import signal
    import subprocess
    import sys

    from tests.rlcli.test_config import REPO

    port = _free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rlcli.cli",
            "serve",
            str(model_dir),
            "--engine",
            "hf",
            "--port",
            str(port),
            "--api-key",
            "sk-test",
        ],
        cwd=REPO,
        env={**_user_shell_env(), "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # started as a background job is (SIGINT ignored): Ctrl-C must still stop it
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        lines = []
        while "api key" not in "".join(lines):
            line = proc.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-test", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["policy"]
        reply = client.chat.completions.create(
            model="policy",
            messages=[{"role": "user", "content": QUESTION}],
            tools=TOOLS,
            temperature=0,
        )
        assert reply.choices[0].message.content == BAD_CALL  # what it memorised, greedy
        text = client.completions.create(model="policy", prompt="What is", max_tokens=3)
        assert text.choices[0].text and text.usage.completion_tokens <= 3
        client.close()  # no keep-alive connection left for the server's shutdown to wait on
    finally:
        proc.send_signal(signal.SIGINT)
        try:  # a hang guard, generous for a loaded 2-core machine; on expiry show its output
            output, _ = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
            raise AssertionError("rlcli serve did not stop on Ctrl-C:\n" + output) from None
    assert proc.returncode == 0, output
    assert "Traceback" not in output


def _user_shell_env() -> dict[str, str]:
    """This process's environment without what an in-process test's process group left in it
    (MASTER_PORT, RANK, ...): a user's shell has none of it."""
    import os

    launcher = {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"}
    return {k: v for k, v in os.environ.items() if k not in launcher}


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.dist
@pytest.mark.vllm
def test_agents_on_rollout_ranks_of_their_own_record_their_weight_version(tmp_path):
    """``rollout.placement=separate`` with ``trainer.max_staleness=1``: the rollout rank serves
    the endpoint and runs the agents (here through ``/v1/completions``), one step ahead of the
    trainer; every trained sample records the weights that generated it."""
    from tests.rlcli.test_run_survival import finish, rlcli_train, rows
    from tests.rlcli.test_separate_placement import ASYNC, BATCH, VLLM

    out = tmp_path / "run"
    agent = "rollout.agent=tests.rlcli.openai_agents:async_numbered_agent"
    budget = "rollout.agent_options.max_response_tokens=64"  # the tiny model holds 512 tokens
    code, output = finish(
        rlcli_train(out, *VLLM, *ASYNC, agent, budget, "trainer.total_steps=3", nproc=2)
    )
    assert code == 0, output[-3000:]
    logged = rows(out)
    assert [r["step"] for r in logged] == [1, 2, 3]
    for row in logged:
        assert row["agent/count"] == BATCH * 4 and row["agent/failure_rate"] == 0.0, row
        assert row["agent/calls_mean"] == 1.0
        assert row["rollout/staleness_max"] <= 1
    assert max(r["rollout/staleness_max"] for r in logged) == 1  # it did run ahead
