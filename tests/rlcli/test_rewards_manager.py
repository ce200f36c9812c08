"""Reward resolution (registry, module path, file path) and the RewardManager's handling of
reward functions that raise, hang, die or return garbage."""

from __future__ import annotations

import math
import os
import textwrap

import pytest

from rlcli.errors import UserError
from rlcli.rewards import (
    REWARDS,
    RewardInput,
    RewardManager,
    get_reward_fn,
    register_reward,
    resolve_reward_fn,
)
from rlcli.rewards import gsm8k as gsm8k_module

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPEC_PREFIX = "tests.rlcli.test_rewards_manager"


# Reward functions the worker processes import by module path.
def exact_match_reward(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(solution_str == ground_truth), "length": len(solution_str)}


def misbehaving_reward(data_source, solution_str, ground_truth, extra_info=None):
    """Behaves according to the response text: the ways user code goes wrong."""
    if solution_str == "raise":
        raise RuntimeError("user code crashed")
    if solution_str == "hang":
        while True:  # a CPU-bound hang: no signal-free way out but killing the process
            pass
    if solution_str == "exit":
        os._exit(3)
    if solution_str == "text":
        return "1.0"
    if solution_str == "nan":
        return math.nan
    if solution_str == "config":
        raise UserError("reward misconfigured: set reward.kwargs.threshold")
    return float(len(solution_str))


def _inputs(*solutions: str) -> list[RewardInput]:
    return [RewardInput("test", solution, "ok", {"i": i}) for i, solution in enumerate(solutions)]


def test_registry_names_and_unknown_name():
    assert {"gsm8k", "math", "arith", "default"} <= set(REWARDS)
    assert get_reward_fn("gsm8k") is gsm8k_module.compute_score

    @register_reward("test_always_half")
    def always_half(data_source, solution_str, ground_truth, extra_info=None):
        return 0.5

    assert resolve_reward_fn("test_always_half")("x", "y", "z") == 0.5
    with pytest.raises(UserError, match="unknown reward function 'nope'; valid names: .*gsm8k"):
        get_reward_fn("nope")
    with pytest.raises(UserError, match="unknown reward function 'nope'.*module:function"):
        resolve_reward_fn("nope")


def test_resolve_by_module_path():
    builtin = resolve_reward_fn("rlcli.rewards.gsm8k:compute_score", {"method": "flexible"})
    assert builtin("gsm8k", "it is 1,250", "1250")["score"] == 1.0
    assert builtin.in_process  # still the builtin, so the fast path applies
    user = resolve_reward_fn(f"{SPEC_PREFIX}:exact_match_reward")
    assert user("x", "ok", "ok") == {"score": 1.0, "length": 2}
    assert not user.in_process


def test_import_failures_name_the_spec_and_the_error(tmp_path):
    with pytest.raises(UserError) as error:
        resolve_reward_fn("no_such_reward_module:compute_score")
    message = str(error.value)
    assert "'no_such_reward_module:compute_score'" in message and "ModuleNotFoundError" in message

    broken = tmp_path / "broken_reward.py"
    broken.write_text("import not_installed_dependency\n")
    with pytest.raises(UserError) as error:
        resolve_reward_fn(f"{broken}:compute_score")
    message = str(error.value)
    assert f"{broken}:compute_score" in message
    assert "No module named 'not_installed_dependency'" in message

    with pytest.raises(UserError, match="has no function 'missing'"):
        resolve_reward_fn("rlcli.rewards.gsm8k:missing")
    with pytest.raises(UserError, match="file not found: .*absent.py"):
        resolve_reward_fn(f"{tmp_path}/absent.py:compute_score")


def test_file_path_function_runs_in_worker_processes(tmp_path):
    reward_file = tmp_path / "my_reward.py"
    reward_file.write_text(
        textwrap.dedent(
            """
            import os

            def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
                return {"score": float(solution_str.strip() == ground_truth) + bonus,
                        "pid": os.getpid()}
            """
        )
    )
    fn = resolve_reward_fn(f"{reward_file}:compute_score", {"bonus": 0.25})
    with RewardManager(fn, timeout_s=30, num_workers=2) as manager:
        scores, extras, stats = manager.score_batch(
            [RewardInput("mine", " 7", "7"), RewardInput("mine", "8", "7")]
        )
    assert scores == [1.25, 0.25]
    assert stats == {"reward/num_failed": 0, "reward/num_timeout": 0}
    assert os.getpid() not in extras["pid"]  # it really ran in other processes


def test_raising_hanging_dying_and_bad_results_score_zero_and_are_counted():
    fn = resolve_reward_fn(f"{SPEC_PREFIX}:misbehaving_reward")
    # Both hangs first, so they share one timeout wave; 2 s leaves room on a loaded machine.
    with RewardManager(fn, timeout_s=2.0, num_workers=2) as manager:
        solutions = ("hang", "hang", "ok", "raise", "abc", "exit", "text", "nan", "abcd")
        scores, _, stats = manager.score_batch(_inputs(*solutions))
        assert scores == [0.0, 0.0, 2.0, 0.0, 3.0, 0.0, 0.0, 0.0, 4.0]
        # raise, exit, text and nan failed; both hangs timed out.
        assert stats == {"reward/num_failed": 4, "reward/num_timeout": 2}

        # The killed workers were replaced: the next batch is scored normally.
        scores, _, stats = manager.score_batch(_inputs("a", "bb", "ccc", "dddd"))
        assert scores == [1.0, 2.0, 3.0, 4.0]
        assert stats == {"reward/num_failed": 0, "reward/num_timeout": 0}


def test_user_error_from_a_reward_stops_training():
    fn = resolve_reward_fn(f"{SPEC_PREFIX}:misbehaving_reward")
    with RewardManager(fn, timeout_s=30, num_workers=1) as manager:
        with pytest.raises(UserError, match="set reward.kwargs.threshold"):
            manager.score_batch(_inputs("ok", "config", "ok"))
        assert manager.score_batch(_inputs("ab"))[0] == [2.0]  # and the pool starts again
    with pytest.raises(UserError, match="no builtin reward for data_source 'test'"):
        RewardManager(get_reward_fn("default")).score_batch(_inputs("#### 1"))


def test_builtin_runs_in_process_and_failures_are_still_counted():
    manager = RewardManager(resolve_reward_fn("gsm8k"))
    assert manager.in_process
    items = [
        {"data_source": "openai/gsm8k", "solution_str": "#### 72", "ground_truth": "72"},
        {"data_source": "openai/gsm8k", "solution_str": "#### 7", "ground_truth": "72"},
    ]
    scores, extras, stats = manager.score_batch(items)
    assert scores == [1.0, 0.0] and extras == {"acc": [1.0, 0.0]}

    forced = RewardManager(misbehaving_reward, in_process=True)
    scores, _, stats = forced.score_batch(_inputs("ab", "raise", "nan"))
    assert scores == [2.0, 0.0, 0.0] and stats["reward/num_failed"] == 2


def test_extras_are_aligned_with_samples():
    fn = resolve_reward_fn(f"{SPEC_PREFIX}:exact_match_reward")
    with RewardManager(fn, timeout_s=30, num_workers=2) as manager:
        scores, extras, _ = manager.score_batch(
            [RewardInput("t", s, "ok") for s in ("ok", "no", "other!")]
        )
    assert scores == [1.0, 0.0, 0.0] and extras == {"length": [2, 2, 6]}

    def sometimes_extra(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": 1.0, "note": solution_str} if solution_str == "b" else 0.0

    _, extras, _ = RewardManager(sometimes_extra, in_process=True).score_batch(_inputs("a", "b"))
    assert extras == {"note": [None, "b"]}


def test_function_that_cannot_reach_a_worker_is_a_user_error():
    with pytest.raises(UserError, match="cannot be sent to worker processes.*module:function"):
        RewardManager(lambda data_source, solution_str, ground_truth, extra_info=None: 1.0)


def test_process_reward_example_scores_each_step(monkeypatch):
    monkeypatch.chdir(REPO_ROOT)  # the spec a user writes is relative to where they run rlcli
    fn = resolve_reward_fn("examples/process_reward.py:compute_score")
    solution = (
        "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
        "Natalia sold 48+24 = 71 clips altogether.\n#### 71"
    )
    with RewardManager(fn, timeout_s=30, num_workers=1) as manager:
        scores, extras, stats = manager.score_batch(
            [
                RewardInput("openai/gsm8k", solution, "72"),
                RewardInput("openai/gsm8k", solution.replace("71", "72"), "72"),
            ]
        )
    # Hand-worked: wrong answer, steps [right, wrong] -> 0.5*0 + 0.5*(1/2); all right -> 1.
    assert scores == [0.25, 1.0]
    assert extras["step_scores"] == [[1.0, 0.0], [1.0, 1.0]]
    assert extras["acc"] == [0.0, 1.0]
    first_step_end = extras["step_end_chars"][0][0]
    assert solution[:first_step_end].endswith("48/2=24")
    assert stats == {"reward/num_failed": 0, "reward/num_timeout": 0}


def test_worker_that_cannot_load_the_function_is_a_user_error(tmp_path):
    reward_file = tmp_path / "vanishing_reward.py"
    reward_file.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n"
    )
    fn = resolve_reward_fn(f"{reward_file}:compute_score")
    reward_file.unlink()  # the parent resolved it; the workers re-resolve and cannot
    with RewardManager(fn, timeout_s=30, num_workers=1) as manager:
        with pytest.raises(UserError, match="could not be loaded in a worker process.*not found"):
            manager.score_batch(_inputs("a"))
