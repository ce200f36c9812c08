"""``rollout.placement=separate`` end to end, through ``rlcli train --nproc 2`` (1 trainer rank, 1
rollout rank with its own engine), on the end-to-end tests' tiny model and task. The staleness 1
run samples with vLLM (the engine that receives the weights on GPU clusters); the comparison
with the colocated run, the killed rank and the user error, which check the placement's bookkeeping, not the
engine, use the HF engine (each vLLM start costs a rank 7-8 s here).

- staleness 0 gives the synchronous colocated run's numbers: the same samples (same rewards,
  lengths, log-prob agreement) and the same update (every logged metric, the checkpoint's model
  and optimizer state in fp32 within 1e-6), both runs distilling from a Megatron teacher (the
  start model, the top-k objective mixed with the task reward) on the trainer's ranks;
- staleness 1: every trained batch records the weights that generated it, never more than one
  version behind the trainer's; the engines evaluate held-out prompts at the trainer's steps; a
  stop (the stop file Slurm's USR1 trap creates) with rollouts in flight checkpoints, and the
  resumed run trains on every prompt once;
- a rollout rank killed mid-run, with rollouts in flight: torchrun restarts the group, the run
  resumes from the checkpoint and loses and repeats no prompt;
- a user error on a rollout rank (a failing reward) ends the run with exit code 2 and its message.
"""

from __future__ import annotations

import math
import re
import time

import pytest
import torch

from tests.rlcli.test_run_survival import (
    HERE,
    checkpoint_tensors,
    comparable,
    finish,
    rlcli_train,
    rows,
)

pytestmark = [pytest.mark.dist, pytest.mark.vllm]

VLLM = ["rollout.engine=vllm"]
SEPARATE = ["rollout.placement=separate", "rollout.num_ranks=1"]
ASYNC = [*SEPARATE, "trainer.max_staleness=1", "algorithm.off_policy_correction=decoupled_ppo"]
# Only the separate placement logs these: how long its engines waited, loaded and generated,
# and how long the trainer waited for them.
SEPARATE_ONLY = ("engine/", "timing/wait_rollout", "sync/wait_s")
BATCH = 4  # prompts per step (tests.rlcli.test_train_e2e.TINY)


def same_run_metrics(row: dict) -> dict:
    return {k: v for k, v in comparable(row).items() if not k.startswith(SEPARATE_ONLY)}


def test_staleness_0_separate_equals_the_colocated_synchronous_run(tmp_path):
    from tests.rlcli.arith_model import build_arith_model

    # The TINY model, built first: it is also the teacher, which must exist at validation.
    base = build_arith_model(
        tmp_path, hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=128
    )
    distill = [
        f"model.path={base}",
        "distill.enable=true",
        f"distill.teacher_path={base}",
        "distill.objective=topk_forward_kl",
        "distill.reward_weight=1",
    ]
    steps = ["trainer.total_steps=3", "checkpoint.save_freq=0", *distill]
    code, output = finish(rlcli_train(tmp_path / "colocated", *steps))
    assert code == 0, output[-3000:]
    code, output = finish(rlcli_train(tmp_path / "separate", *steps, *SEPARATE, nproc=2))
    assert code == 0, output[-3000:]
    colocated, separate = rows(tmp_path / "colocated"), rows(tmp_path / "separate")
    assert [r["step"] for r in separate] == [1, 2, 3]
    for a, b in zip(colocated, separate, strict=True):
        assert b["rollout/staleness_max"] == 0 and b["rollout/logprob_diff_mean"] < 1e-5
        assert same_run_metrics(a) == same_run_metrics(b), a["step"]
        assert "timing/teacher" in b and math.isfinite(b["actor/distill_loss"])
    assert separate[-1]["actor/distill_loss"] > 1e-6  # the student has moved off its teacher
    whole = checkpoint_tensors(tmp_path / "colocated" / "checkpoints" / "step_000003", tmp_path)
    split = checkpoint_tensors(tmp_path / "separate" / "checkpoints" / "step_000003", tmp_path)
    assert whole.keys() == split.keys()
    for key in whole:
        assert torch.allclose(whole[key].double(), split[key].double(), rtol=0, atol=1e-6), key


def expected_staleness(step: int, start: int, k: int = 1) -> int:
    """Step ``step``'s samples come from the weights max(start, step - 1 - k)."""
    return (step - 1) - max(start, step - 1 - k)


def check_async_rows(logged: list[dict], start_of: dict[int, int]) -> None:
    for row in logged:
        step = row["step"]
        age = expected_staleness(step, start_of[step])
        # mean == max: every sample of the batch records the same (generating) version
        assert row["rollout/staleness_max"] == row["rollout/staleness_mean"] == age, row
        assert age <= 1
        # agreement only on samples of the trainer's own weights; correction weights otherwise
        assert ("rollout/logprob_diff_mean" in row) == (age == 0), row
        if age == 0:
            assert row["rollout/logprob_diff_mean"] < 1e-5
        assert math.isfinite(row["actor/is_weight_mean"])
        assert row["data/position"] == step * BATCH  # every prompt trained once, in order


def test_staleness_1_records_versions_evaluates_and_resumes_after_a_stop(tmp_path):
    out = tmp_path / "run"
    stop_file = tmp_path / "stop"
    stop_file.touch()  # the run stops after its first step, with the second in flight
    env = {"RLCLI_STOP_FILE": str(stop_file)}
    run = [*VLLM, *ASYNC, "trainer.total_steps=4", "trainer.val_freq=2"]
    run += ["trainer.val_before_train=true"]
    code, output = finish(rlcli_train(out, *run, env=env, nproc=2))
    assert code == 0, output[-3000:]
    assert "checkpoint saved: run the same command again" in output
    first = rows(out)
    assert [r["step"] for r in first] == [0, 1]  # step 0: the held-out accuracy before RL
    assert "val/reward/accuracy" in first[0]
    stop_file.unlink()
    code, output = finish(rlcli_train(out, *run, env=env, nproc=2))
    assert code == 0, output[-3000:]
    assert "resumed from step 1" in output
    logged = rows(out)
    assert [r["step"] for r in logged] == [0, 1, 2, 3, 4]
    check_async_rows(logged[1:], start_of={1: 0, 2: 1, 3: 1, 4: 1})
    # The engines evaluated the trainer's weights of steps 2 and 4 (val_freq, the last step).
    assert [r["step"] for r in logged if "val/reward/accuracy" in r] == [0, 2, 4]


def test_rollout_rank_killed_with_rollouts_in_flight_resumes_without_losing_prompts(tmp_path):
    """Rank 1 (the rollout rank, which scores the rewards) SIGKILLs itself once step 2's
    checkpoint exists: one step ahead of the trainer, with the samples of the step the trainer
    trains sent or being sent."""
    out = tmp_path / "run"
    marker = tmp_path / "killed"
    env = {
        "RLCLI_TEST_KILL_AFTER": str(out / "checkpoints" / "step_000002"),
        "RLCLI_TEST_KILL_MARKER": str(marker),
    }
    run = [*ASYNC, f"reward.fn={HERE / 'killing_reward.py'}:compute_score"]
    proc = rlcli_train(out, *run, "trainer.total_steps=5", "--max-restarts", "2", env=env, nproc=2)
    deadline = time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    code, output = finish(proc)
    assert code == 0, output[-5000:]
    assert marker.exists(), "the rollout rank was never killed"
    # The newest checkpoint when it died: step 2's, or a later one the trainer wrote meanwhile.
    resumed = re.search(r"resumed from step (\d+)", output)
    assert resumed is not None and 2 <= int(resumed.group(1)) < 5, output[-3000:]
    start = int(resumed.group(1))
    logged = rows(out)
    assert [r["step"] for r in logged] == [1, 2, 3, 4, 5]  # each step logged once
    check_async_rows(logged, start_of={s: 0 if s <= start else start for s in range(1, 6)})


def test_a_user_error_on_a_rollout_rank_exits_2_with_its_message(tmp_path):
    code, output = finish(
        rlcli_train(
            tmp_path / "run",
            *SEPARATE,
            f"reward.fn={HERE / 'failing_reward.py'}:compute_score",
            "trainer.total_steps=2",
            nproc=2,
        )
    )
    assert code == 2, output[-5000:]
    assert "reward.max_failure_rate=0.5" in output
    assert "Traceback" not in output.split("error:")[-1]
