"""A real run's checkpoint with a truncated megatron shard, as a user meets it: an explicit
``trainer.resume`` stops with exit code 2 naming the checkpoint, the file and the sizes (it used
to be an ``EOFError`` traceback from torch's unpickler); ``rlcli checkpoint verify`` lists it as
damaged (exit 1); ``trainer.resume=auto`` says it skips it, resumes from the step before and
saves that step again, intact. (Every kind of damage, on plain files: test_checkpoint_manifest.)"""

from __future__ import annotations

import subprocess
import sys

from tests.rlcli.test_run_survival import finish, rlcli_train, rows
from tests.rlcli.test_train_e2e import REPO


def _verify(folder) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "rlcli.cli", "checkpoint", "verify", str(folder)]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)


def test_a_damaged_checkpoint_is_named_and_skipped(tmp_path):
    out = tmp_path / "run"
    code, output = finish(rlcli_train(out, "trainer.total_steps=2"))
    assert code == 0, output[-3000:]
    checkpoints = out / "checkpoints"
    damaged = checkpoints / "step_000002"
    shard = sorted((damaged / "model").glob("*.distcp"))[0]
    size = shard.stat().st_size
    with open(shard, "r+b") as handle:
        handle.truncate(100)
    named = f"{shard.relative_to(damaged).as_posix()} is 100 bytes, its manifest says {size}"

    code, output = finish(rlcli_train(out, "trainer.total_steps=2", f"trainer.resume={damaged}"))
    assert code == 2, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert f"trainer.resume={str(damaged)!r}: the checkpoint is damaged: {named}" in output

    listing = _verify(checkpoints)
    assert listing.returncode == 1, listing.stdout + listing.stderr
    assert f"{damaged}  damaged      {named}" in listing.stdout
    assert "1 intact, 1 damaged, 0 unverifiable; trainer.resume=auto takes step_000001" in (
        listing.stdout
    )

    code, output = finish(rlcli_train(out, "trainer.total_steps=2"))  # trainer.resume=auto
    assert code == 0, output[-3000:]
    assert f"trainer.resume=auto: skipping damaged checkpoint {damaged}: {named}" in output
    assert f"resuming from {checkpoints / 'step_000001'}, the newest intact checkpoint" in output
    assert "resumed from step 1" in output
    assert [row["step"] for row in rows(out)] == [1, 2]
    assert _verify(checkpoints).returncode == 0  # step 2 saved again, intact
