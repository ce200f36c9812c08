"""The channel between trainer rank 0 and the rollout ranks: a real TCP store and a real gloo
samples group of two ranks, as ``parallel.roles`` builds them, in two spawned processes (one per
role: a gloo group's constructor holds the GIL while it meets its peer, so threads cannot)."""

from __future__ import annotations

import multiprocessing
import socket
import time
import traceback
from datetime import timedelta

import pytest

from rlcli.errors import UserError
from rlcli.rollout.batch import Sample
from rlcli.rollout.channel import Notice, RolloutChannel, RunEnded, StreamedBatch


def channel(role: str, port: int) -> RolloutChannel:
    import torch.distributed as dist

    from parallel.roles import RoleWorld

    rank = 0 if role == "trainer" else 1
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    samples = dist.ProcessGroupGloo(dist.PrefixStore("samples/", store), rank, 2)
    world = RoleWorld(role, 0, 1, rank, 2, 1, store, None, samples)
    return RolloutChannel(world, timeout_s=60)


def batch(step: int) -> StreamedBatch:
    sample = Sample(0, [1, 2], [3], [-0.5], "stop", None, score=float(step))
    return StreamedBatch(step, [sample], {"reward/score_mean": float(step)}, step - 1, {}, {})


def trainer_side(c: RolloutChannel) -> None:
    c.send_notice(Notice(0, weights=True, start_loader={"position": 8}))
    c.send_notice(Notice(1))
    while not c.store.check(["val/3"]):  # sent after all three batches: none waited for us
        time.sleep(0.01)
    for step in (1, 2, 3):
        got = c.receive_batch(step)
        assert (got.step, got.samples[0].score, got.weight_version) == (step, step, step - 1)
    assert c.receive_validation(3) == {"val/reward/accuracy": 0.5}
    assert c.stop_requested() == "SIGTERM"
    try:
        c.receive_batch(4)
        raise AssertionError("the rollout side's user error did not reach the trainer")
    except UserError as error:
        assert "reward.fn failed: bad reward" in str(error)
    c.report_failure(RuntimeError("the trainer crashed"))


def rollout_side(c: RolloutChannel) -> None:
    first = c.receive_notice()
    assert (first.version, first.weights, first.start_loader) == (0, True, {"position": 8})
    assert c.receive_notice().version == 1
    for step in (1, 2, 3):  # none waits for the trainer to take it
        c.send_batch(batch(step))
    c.send_validation(3, {"val/reward/accuracy": 0.5})
    c.request_stop("SIGTERM")
    c.report_failure(UserError("reward.fn failed: bad reward"))
    polls = []
    try:
        c.receive_notice(between_polls=lambda: polls.append(1))
        raise AssertionError("the trainer's failure did not end the rollout side's wait")
    except RunEnded:
        assert polls  # it kept polling (and running the caller's checks) while it waited


def run_side(role: str, port: int, errors) -> None:
    try:
        (trainer_side if role == "trainer" else rollout_side)(channel(role, port))
    except BaseException:
        errors.put(f"{role}: {traceback.format_exc()}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_notices_batches_validation_stop_and_failures_cross_between_the_roles():
    context = multiprocessing.get_context("spawn")
    errors = context.Queue()
    port = free_port()
    sides = [
        context.Process(target=run_side, args=(r, port, errors)) for r in ("trainer", "rollout")
    ]
    for side in sides:
        side.start()
    for side in sides:
        side.join(timeout=240)
    found = [errors.get() for _ in range(errors.qsize())] if not errors.empty() else []
    assert not found, "\n".join(found)
    assert [side.exitcode for side in sides] == [0, 0]


def test_a_crash_on_a_rollout_rank_is_reported_as_no_user_error():
    import torch.distributed as dist

    from parallel.roles import RoleWorld

    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30))
    trainer, rollout = (
        RolloutChannel(RoleWorld(role, 0, 1, 0, 2, 1, store, None, None), timeout_s=30)
        for role in ("trainer", "rollout")
    )
    rollout.report_failure(ValueError("boom"))
    with pytest.raises(RuntimeError, match=r"a rollout rank failed: ValueError\('boom'\)"):
        trainer.receive_validation(0)
