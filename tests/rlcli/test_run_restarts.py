"""Runs that lose a rank or meet a user error under torchrun: the group restarts from the newest
checkpoint and leaves no process behind, and a user error is printed once and not retried.
(The single-process survival tests and their helpers: test_run_survival.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

from tests.rlcli.test_run_survival import (
    HERE,
    REPO,
    RUN_TAG,
    finish,
    processes_left,
    processes_of_run,
    rlcli_train,
    rows,
)


@pytest.mark.dist
def test_rank_killed_mid_run_restarts_and_finishes(tmp_path):
    """`--nproc 2 --max-restarts 2`: rank 1 SIGKILLs itself during step 3; torchrun restarts the
    group, which resumes from step 2's checkpoint and finishes; each step is logged once; and
    no process of the run is left once it has finished (the killed rank's checkpoint-writer
    Manager used to stay, with parent 1)."""
    out = tmp_path / "run"
    marker = tmp_path / "killed"
    tag = f"survival-{os.getpid()}-{time.monotonic_ns()}"
    env = {
        "RLCLI_TEST_KILL_AFTER": str(out / "checkpoints" / "step_000002"),
        "RLCLI_TEST_KILL_MARKER": str(marker),
        RUN_TAG: tag,
    }
    proc = rlcli_train(
        out,
        f"reward.fn={HERE / 'killing_reward.py'}:compute_score",
        "trainer.total_steps=4",
        "--max-restarts",
        "2",
        env=env,
        nproc=2,
    )
    killed_at = first_step_after = None
    before_kill: dict[int, str] = {}
    seen: dict[int, str] = {}
    helpers: set[int] = set()
    names: set[str] = set()
    next_sample = 0.0
    deadline = time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        now = time.monotonic()
        if killed_at is None and marker.exists():
            killed_at = now
        if now >= next_sample:
            sample = processes_of_run(tag)
            seen.update(sample)
            helpers |= forked_or_spawned_helpers(sample)
            names |= process_names(sample)
            before_kill = sample if killed_at is None else before_kill
            next_sample = now + 1.0
        if (
            killed_at is not None
            and first_step_after is None
            and any(r["step"] == 3 for r in rows(out))
        ):
            first_step_after = now
        time.sleep(0.1)
    code, output = finish(proc)
    assert code == 0, output[-5000:]
    assert marker.exists(), "rank 1 was never killed"
    assert [r["step"] for r in rows(out)] == [1, 2, 3, 4]
    assert "resumed from step 2" in output
    # The ranks were forked from torchrun's forkserver with the training stack imported (no
    # NVIDIA GPU here: rlcli.commands.relaunch), and named themselves.
    assert {"rlcli-rank0", "rlcli-rank1"} <= names, names
    managers = [pid for pid in seen if pid in helpers]
    # Two ranks saved before the kill, two restarted ranks after: the count can see them.
    assert len(managers) >= 3, seen
    left = processes_left(tag)
    print(f"processes of the run: {len(before_kill)} before the kill, {len(left)} after the end")
    assert left == {}, left
    if first_step_after is not None:
        print(f"restart-to-first-step: {first_step_after - killed_at:.1f} s")


@pytest.mark.dist
def test_a_user_error_is_not_retried_by_torchrun_restarts(tmp_path):
    """A reward that fails on every sample stops the run with exit 2 and its own message, once:
    the ranks ask torchrun to stop instead of being restarted --max-restarts times, and leave
    no process behind (reward workers included)."""
    out = tmp_path / "run"
    tag = f"user-error-{os.getpid()}-{time.monotonic_ns()}"
    code, output = finish(
        rlcli_train(
            out,
            f"reward.fn={HERE / 'failing_reward.py'}:compute_score",
            "trainer.total_steps=2",
            "--max-restarts",
            "3",
            env={RUN_TAG: tag},
            nproc=2,
        )
    )
    assert code == 2, output[-5000:]
    assert "reward.max_failure_rate=0.5" in output
    assert "TypeError: compute_score() got an unexpected keyword argument" in output
    assert "ChildFailedError" not in output
    assert output.count("building actor") == 1  # one start, no restarts
    assert processes_left(tag) == {}


@pytest.mark.dist
def test_a_user_error_under_torchrun_by_hand_is_printed_and_not_retried(tmp_path):
    """torchrun started by hand (as sbatch does) with restarts: the rank prints the error itself,
    then stops its agent. Stopping the agent first let it SIGTERM the rank before the message was
    out (seen under load: the job failed with no word of why)."""
    recipe = tmp_path / "broken.yaml"
    recipe.write_text("nonsense_section:\n  value: 1\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    cmd += ["--max-restarts", "3", "--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0"]
    cmd += ["-m", "rlcli.cli", "train", str(recipe)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    output = out.stdout + out.stderr
    assert out.returncode != 0, output[-3000:]
    assert "nonsense_section" in output, output[-3000:]
    # Two ranks, one attempt: at most one line each (a restart would print more).
    assert output.count("nonsense_section") <= 2, output[-3000:]


def process_names(sample: dict[int, str]) -> set[str]:
    """What ps shows as the name of each process of a sample."""
    names = set()
    for pid in sample:
        try:
            names.add(psutil.Process(pid).name())
        except psutil.NoSuchProcess:
            continue
    return names


def forked_or_spawned_helpers(sample: dict[int, str]) -> set[int]:
    """The checkpoint writer's Managers (and writer processes) among a run's processes: a spawned
    one runs multiprocessing.spawn, a forked one (CPU: parallel.cpu_compat) the command line of
    the rank it was forked from."""
    found = set()
    for pid, command in sample.items():
        try:
            parent = psutil.Process(pid).ppid()
        except psutil.NoSuchProcess:
            continue
        if "multiprocessing.spawn" in command or sample.get(parent) == command:
            found.add(pid)
    return found
