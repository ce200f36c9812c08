"""Test-only reward for the fault-injection test: scores like ``length_reward`` and, on rank 1,
once the checkpoint named by ``RLCLI_TEST_KILL_AFTER`` exists and ``RLCLI_TEST_KILL_MARKER``
does not yet, creates the marker and SIGKILLs its trainer process (a dead rank mid-step).

Reward functions given by file run in forkserver workers: the trainer is the worker's parent's
parent."""

import os
import signal


def _trainer_pid() -> int:
    with open(f"/proc/{os.getppid()}/stat") as handle:
        return int(handle.read().rsplit(")", 1)[1].split()[1])


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    after, marker = (
        os.environ.get("RLCLI_TEST_KILL_AFTER"),
        os.environ.get("RLCLI_TEST_KILL_MARKER"),
    )
    if os.environ.get("RANK") == "1" and after and marker and os.path.exists(after):
        try:
            descriptor = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            descriptor = None
        if descriptor is not None:
            os.close(descriptor)
            os.kill(_trainer_pid(), signal.SIGKILL)
    digits = sum(ch.isdigit() for ch in solution_str)
    return {"score": digits / 10.0, "acc": float(str(ground_truth) in solution_str)}
