"""Runs that survive: non-finite steps, the LR schedule in RL steps, resume with a changed config,
Ctrl-C, exact resume (GRPO and DAPO). (Restarts under torchrun, with these helpers:
test_run_restarts.py.)

Single-process runs use the HF engine and a tiny Qwen2 (the end-to-end tests' settings); weights
are compared by reading the checkpoints' torch-distributed shards back with torch's converter.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from tests.rlcli.test_train_e2e import REPO, TINY

HERE = Path(__file__).parent
HF = [*TINY, "rollout.engine=hf"]
# Environment variable a test sets to recognise every process of its run.
RUN_TAG = "RLCLI_TEST_RUN_TAG"
# Metrics that measure time or memory: they differ between any two runs.
TIMING_PREFIXES = ("timing/", "perf/", "system/", "sync/gbps")


def rlcli_train(out: Path, *overrides: str, env: dict | None = None, nproc: int = 1):
    cmd = [sys.executable, "-m", "rlcli.cli", "train"]
    cmd += ["--nproc", str(nproc)] if nproc > 1 else []
    cmd += [str(REPO / "recipes" / "quickstart.yaml"), *HF, f"trainer.output_dir={out}"]
    cmd += list(overrides)
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    # Output goes to a file, not a pipe: a test that polls the run does not read a pipe, and a
    # full pipe would block the ranks.
    log = open(out.parent / f"{out.name}-{time.monotonic_ns()}.log", "w+")
    proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=log, stderr=subprocess.STDOUT)
    proc.log = log  # type: ignore[attr-defined]
    return proc


def finish(proc: subprocess.Popen, timeout: float = 600) -> tuple[int, str]:
    proc.wait(timeout=timeout)
    log = proc.log  # type: ignore[attr-defined]
    log.seek(0)
    output = log.read()
    log.close()
    return proc.returncode, output


def rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def comparable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(TIMING_PREFIXES)}


def checkpoint_tensors(step_dir: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint's model/ folder (model and optimizer state)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = tmp / f"{step_dir.parent.parent.name}-{step_dir.name}.pt"
    dcp_to_torch_save(str(step_dir / "model"), str(target))
    state = torch.load(target, weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def lr_at(k: int, lr: float, min_lr: float, warmup: int, total: int) -> float:
    """Megatron's linear warmup (from 0) and linear decay, after ``k`` schedule steps."""
    if k <= warmup:
        return lr * k / warmup
    return lr - (lr - min_lr) * (k - warmup) / (total - warmup)


def test_nonfinite_steps_are_dropped_counted_and_stop_the_run(tmp_path):
    """algorithm.epsilon=0 with equal rewards: every GRPO advantage is 0/0 = NaN."""
    out = tmp_path / "run"
    code, output = finish(
        rlcli_train(
            out,
            f"reward.fn={HERE / 'constant_reward.py'}:compute_score",
            "algorithm.epsilon=0",
            "trainer.max_nonfinite_steps=2",
            "trainer.total_steps=4",
        )
    )
    assert code == 2, output[-3000:]
    assert "Traceback" not in output
    assert "step 2: 2 steps in a row had a non-finite loss or gradient" in output
    assert "trainer.max_nonfinite_steps=2" in output and "algorithm.epsilon" in output
    logged = rows(out)
    assert [r["step"] for r in logged] == [1, 2]
    assert all(r["actor/nonfinite_steps"] == r["actor/optimizer_steps"] == 2 for r in logged)
    assert all(math.isnan(r["actor/grad_norm"]) for r in logged)
    # Step 1 (dropped, weights unchanged) was saved; step 2 ended the run before its save.
    saved = sorted(p.name for p in (out / "checkpoints").glob("step_*"))
    assert saved == ["step_000001"]
    tensors = checkpoint_tensors(out / "checkpoints" / "step_000001", tmp_path)
    assert tensors and all(torch.isfinite(t).all() for t in tensors.values())


def test_steps_without_an_update_are_said_and_stop_the_run(tmp_path):
    """DAPO with a reward that never varies: its filter keeps no group, so no step updates the
    actor; each says so, and trainer.max_skipped_steps of them in a row stop the run (exit 2)."""
    out = tmp_path / "run"
    code, output = finish(
        rlcli_train(
            out,
            f"reward.fn={HERE / 'constant_reward.py'}:compute_score",
            "algorithm.dynamic_sampling.enabled=true",
            "algorithm.dynamic_sampling.max_gen_batches=1",
            "trainer.max_skipped_steps=2",
            "trainer.total_steps=4",
        )
    )
    assert code == 2, output[-3000:]
    assert "Traceback" not in output
    said = [s for s in output.splitlines() if "no update: DAPO kept" in s]
    assert (
        said[0]
        == "[rlcli] step 1: no update: DAPO kept 0/4 groups (varying score) < 1 DP ranks; 1 in a row"
    )
    assert len(said) == 2 and all(len(s) <= 100 for s in said)
    assert "step 2: 2 steps in a row applied no update (trainer.max_skipped_steps=2)" in output
    assert "DAPO's filter kept 0 of the 4 groups drawn (those whose score varies)" in output
    logged = rows(out)
    assert [r["step"] for r in logged] == [1, 2]
    assert all(r["actor/skipped_update"] == 1.0 and r["dapo/kept_groups"] == 0 for r in logged)


def test_lr_schedule_counts_rl_steps_and_resume_takes_the_new_lr(tmp_path):
    """2 mini-batches per step (4 prompts, ppo_mini_batch_size 2): the schedule still moves once
    per RL step; a resume with a larger actor.lr and total_steps follows the new values."""
    out = tmp_path / "run"
    schedule = ["actor.lr_warmup_steps=2", "actor.lr_decay_style=linear", "actor.min_lr=1e-4"]
    code, output = finish(rlcli_train(out, *schedule, "actor.lr=1e-3", "trainer.total_steps=4"))
    assert code == 0, output[-3000:]
    first = rows(out)
    assert [r["actor/optimizer_steps"] for r in first] == [2.0] * 4
    for row in first:
        want = lr_at(row["step"] - 1, 1e-3, 1e-4, warmup=2, total=4)
        assert row["actor/lr"] == pytest.approx(want, rel=1e-9, abs=1e-12), row["step"]

    code, output = finish(rlcli_train(out, *schedule, "actor.lr=2e-3", "trainer.total_steps=5"))
    assert code == 0, output[-3000:]
    assert "resumed from step 4" in output
    assert "max_lr: 0.001 -> 0.002" in output  # the change is logged
    last = rows(out)[-1]
    assert last["step"] == 5
    assert last["actor/lr"] == pytest.approx(lr_at(4, 2e-3, 1e-4, warmup=2, total=5), rel=1e-9)


def _resume_equals_uninterrupted(
    tmp_path: Path,
    *overrides: str,
    sigterm: bool,
    stop_signal: int = signal.SIGTERM,
    whole: Path | None = None,
    rerun_finished: bool = False,
) -> None:
    """An uninterrupted run (``total_steps(sigterm)`` steps) against one stopped after a step
    (`stop_signal`, or the stop file the sbatch script uses) and started again: same weights,
    optimizer state, metrics and loader positions; the stopped run leaves no process behind (its
    checkpoint writer included). ``whole``: the uninterrupted run, already made with these
    overrides. ``rerun_finished``: the uninterrupted run, started again, has nothing to do."""
    total = total_steps(sigterm)
    steps = [f"trainer.total_steps={total}", *overrides]
    if whole is None:
        whole = tmp_path / "whole"
        code, output = finish(rlcli_train(whole, *steps))
        assert code == 0, output[-3000:]
    if rerun_finished:
        # The finished run again: its checkpoint records the settings as given, so there is
        # nothing to do (exit 0, before any model is built).
        code, output = finish(rlcli_train(whole, *steps))
        assert code == 0 and "[rlcli] nothing to do:" in output, output[-3000:]
        assert "building actor" not in output
        assert [r["step"] for r in rows(whole)] == list(range(1, total + 1))

    split = tmp_path / "split"
    stop_file = tmp_path / "stop"
    tag = f"stopped-{os.getpid()}-{time.monotonic_ns()}"
    env = {RUN_TAG: tag, **({} if sigterm else {"RLCLI_STOP_FILE": str(stop_file)})}
    if not sigterm:
        stop_file.touch()  # asks the run to stop after its first step
    proc = rlcli_train(split, *steps, env=env)
    if sigterm:
        deadline = time.monotonic() + 600
        while not rows(split) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        proc.send_signal(stop_signal)  # while step 2 runs (or just after step 1)
    code, output = finish(proc)
    assert code == 0, output[-3000:]  # the documented code: 0, with a checkpoint
    assert "checkpoint saved: run the same command again" in output
    if sigterm:
        assert f"{signal.Signals(stop_signal).name}: stopping after this step" in output
    assert processes_left(tag) == {}
    stopped_at = max(r["step"] for r in rows(split))
    assert stopped_at < total
    assert (split / "checkpoints" / f"step_{stopped_at:06d}" / "COMPLETE").is_file()

    stop_file.unlink(missing_ok=True)
    code, output = finish(rlcli_train(split, *steps, env=env))
    assert code == 0, output[-3000:]
    assert f"resumed from step {stopped_at}" in output
    # the run's last lines: what it did and where everything went (logging.backends=[jsonl])
    saved = split / "checkpoints" / f"step_{total:06d}"
    assert f"[rlcli] done: step {total} of {total} ({total - stopped_at} steps since" in output
    assert f"[rlcli] checkpoint: {saved}" in output
    assert f"[rlcli] metrics: {split / 'metrics.jsonl'}" in output and "TensorBoard" not in output
    assert [r["step"] for r in rows(split)] == list(range(1, total + 1))
    assert [comparable(r) for r in rows(split)] == [comparable(r) for r in rows(whole)]
    last = f"step_{total:06d}"
    a = checkpoint_tensors(whole / "checkpoints" / last, tmp_path)
    b = checkpoint_tensors(split / "checkpoints" / last, tmp_path)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.allclose(a[key].double(), b[key].double(), rtol=0, atol=1e-6), key
    whole_state, split_state = (
        json.loads((run / "checkpoints" / last / "trainer_state.json").read_text())
        for run in (whole, split)
    )
    assert split_state["step"] == whole_state["step"] == total
    assert split_state["loader"] == whole_state["loader"]
    assert split_state["settings"]["trainer.total_steps"] == total
    assert split_state["settings"]["data.train_files"] == []  # as given, not as filled in


def total_steps(sigterm: bool) -> int:
    """The stop file stops a run after its first step: 2 steps leave one to resume. A SIGTERM
    lands during step 1 or step 2 (the test sends it once step 1 is logged): 3 steps."""
    return 3 if sigterm else 2


# The GRPO run the Ctrl-C test stops and resumes, with a log-prob limit no run meets: its warning
# changes nothing the run computes, so one uninterrupted run serves both tests. Deterministic
# mode (torch's deterministic algorithms) on: the stopped-and-resumed run must still equal it.
WARN = ["rollout.max_logprob_diff=1e-12", "trainer.deterministic=true"]


@pytest.fixture(scope="module")
def grpo_whole(tmp_path_factory) -> tuple[Path, str]:
    """The uninterrupted GRPO run (``WARN``) and its output."""
    out = tmp_path_factory.mktemp("grpo") / "whole"
    code, output = finish(rlcli_train(out, f"trainer.total_steps={total_steps(True)}", *WARN))
    assert code == 0, output[-3000:]
    return out, output


def test_ctrl_c_checkpoints_and_grpo_resume_equals_uninterrupted(tmp_path, grpo_whole):
    """Ctrl-C (SIGINT) stops after the step with a checkpoint; the finished run has nothing to do.
    (SIGTERM and SIGUSR1 take the same handler: test_process_lifetime.py.)"""
    _resume_equals_uninterrupted(
        tmp_path,
        *WARN,
        sigterm=True,
        stop_signal=signal.SIGINT,
        whole=grpo_whole[0],
        rerun_finished=True,
    )


def test_dapo_resume_equals_uninterrupted(tmp_path):
    _resume_equals_uninterrupted(
        tmp_path,
        "algorithm.dynamic_sampling.enabled=true",
        "algorithm.dynamic_sampling.max_gen_batches=3",
        "data.train_batch_size=2",
        "actor.ppo_mini_batch_size=1",
        sigterm=False,
    )


def processes_of_run(tag: str) -> dict[int, str]:
    """Running processes whose environment carries ``RLCLI_TEST_RUN_TAG=tag`` (everything a run
    starts inherits it): pid -> command line. Zombies count as ended (this container's init does
    not reap orphans)."""
    found = {}
    for process in psutil.process_iter():
        try:
            if process.environ().get(RUN_TAG) == tag and process.status() != psutil.STATUS_ZOMBIE:
                found[process.pid] = " ".join(process.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def processes_left(tag: str, within_s: float = 20) -> dict[int, str]:
    """The run's processes still running ``within_s`` after it ended (killed then, so that a
    failing test leaves nothing either)."""
    deadline = time.monotonic() + within_s
    while (left := processes_of_run(tag)) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


def test_logprob_diff_over_the_limit_warns_or_stops(tmp_path, grpo_whole):
    """fp32 on CPU agrees to ~1e-7 per token; a limit below that trips the check (the warning:
    in the uninterrupted GRPO run, which finished with exit 0)."""
    _, output = grpo_whole
    assert "warning: step 1: the trainer's and the engine's log-probs" in output
    assert "rollout.max_logprob_diff=1e-12" in output
    stop = [*WARN, "trainer.total_steps=1", "rollout.logprob_diff_action=stop"]
    code, output = finish(rlcli_train(tmp_path / "stop", *stop))
    assert code == 2, output[-3000:]
    assert "step 1:" in output and "rollout.logprob_diff_action=stop" in output
    assert "Traceback" not in output
