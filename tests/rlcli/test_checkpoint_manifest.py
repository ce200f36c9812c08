"""Checkpoint manifests on plain files: what a commit records, how each kind of damage is named,
the fallback of ``trainer.resume=auto`` and of torchrun restarts, pruning around a damaged
checkpoint, old checkpoints without a manifest, and ``rlcli checkpoint verify``'s listing and exit
codes. (A real run's checkpoint with a damaged shard is ``test_checkpoint_resume_e2e.py``.)"""

from __future__ import annotations

import binascii
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlcli.cli import main
from rlcli.errors import UserError
from rlcli.run.checkpoints import CheckpointManager
from rlcli.run.manifest import (
    MANIFEST_FILE,
    check_checkpoint,
    shard_writers,
    share_of_files,
)
from rlcli.run.state import RunState, save_run_state
from tests.rlcli.checkpoint_steps import complete_steps

SHARD = "model/__0_0.distcp"


def _save(manager: CheckpointManager, step: int) -> Path:
    """A checkpoint shaped like a run's: a binary shard, the trainer state (JSON) and the RNG
    states (safetensors)."""
    with manager.saving(step, subdirs=("model",)) as directory:
        (directory / SHARD).write_bytes(os.urandom(40_000))
        (directory / "model" / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
        save_run_state(directory, RunState(step=step, kl_coef=0.05), rank=0)
    return manager.step_dir(step)


def _truncate_shard(step_dir: Path) -> None:
    with open(step_dir / SHARD, "r+b") as handle:
        handle.truncate(100)


def _delete_shard(step_dir: Path) -> None:
    (step_dir / SHARD).unlink()


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def _flip_rng_byte(step_dir: Path) -> None:
    # The last byte is tensor data: the file still parses, so nothing but the manifest would
    # notice (the run would resume with another random state).
    path = step_dir / "rng_state_rank0.safetensors"
    _flip_last_byte(path)
    assert set(load_file(path)) >= {"python", "numpy", "torch_cpu"}


def _edit_trainer_state(step_dir: Path) -> None:
    path = step_dir / "trainer_state.json"
    path.write_text(path.read_text().replace('"kl_coef": 0.05', '"kl_coef": 0.07'))


DAMAGES = {
    "truncated shard": (_truncate_shard, SHARD, "is 100 bytes, its manifest says 40000"),
    "deleted shard": (_delete_shard, SHARD, "is missing"),
    "flipped byte in a safetensors file": (
        _flip_rng_byte,
        "rng_state_rank0.safetensors",
        "has CRC-32",
    ),
    "damaged trainer state": (_edit_trainer_state, "trainer_state.json", "has CRC-32"),
}


def test_the_manifest_lists_every_file_with_its_size_and_crc32(tmp_path):
    manager = CheckpointManager(tmp_path)
    step_dir = _save(manager, 1)
    manifest = json.loads((step_dir / MANIFEST_FILE).read_text())
    on_disk = sorted(
        path.relative_to(step_dir).as_posix()
        for path in step_dir.rglob("*")
        if path.is_file() and path.name not in ("COMPLETE", MANIFEST_FILE)
    )
    assert [entry["path"] for entry in manifest["files"]] == on_disk
    for entry in manifest["files"]:
        data = (step_dir / entry["path"]).read_bytes()
        assert entry["size"] == len(data)
        assert int(entry["crc32"], 16) == binascii.crc32(data)  # an independent CRC-32
    assert check_checkpoint(step_dir).state == "intact"


@pytest.mark.parametrize("damage", DAMAGES)
def test_damage_is_named_for_an_explicit_resume_and_auto_falls_back(tmp_path, capsys, damage):
    break_it, file, difference = DAMAGES[damage]
    manager = CheckpointManager(tmp_path)
    first, second = _save(manager, 1), _save(manager, 2)
    break_it(second)

    with pytest.raises(UserError) as error:
        manager.resolve_resume(second)
    message = str(error.value)
    assert f"trainer.resume={str(second)!r}: the checkpoint is damaged" in message
    assert f"{file} {difference}" in message
    assert "rlcli checkpoint verify" in message

    assert manager.resolve_resume("auto") == first
    printed = capsys.readouterr().out
    assert f"skipping damaged checkpoint {second}: {file} {difference}" in printed
    assert f"resuming from {first}, the newest intact checkpoint" in printed


def test_a_torchrun_restart_takes_the_newest_intact_checkpoint(tmp_path, capsys):
    manager = CheckpointManager(tmp_path)
    first, second = _save(manager, 1), _save(manager, 2)
    _truncate_shard(second)
    # The first start named a fresh start (or any checkpoint): a restart continues the run.
    assert manager.resolve_resume("none", restarted=True) == first
    assert manager.resolve_resume(second, restarted=True) == first
    assert "torchrun restarted the group: skipping damaged checkpoint" in capsys.readouterr().out


def test_without_any_intact_checkpoint_auto_stops_and_names_each(tmp_path):
    manager = CheckpointManager(tmp_path)
    first, second = _save(manager, 1), _save(manager, 2)
    _truncate_shard(first)
    _delete_shard(second)
    with pytest.raises(UserError) as error:
        manager.resolve_resume("auto")
    message = str(error.value)
    assert "every checkpoint under" in message and "trainer.resume=none" in message
    assert f"step_000001: {SHARD} is 100 bytes" in message
    assert f"step_000002: {SHARD} is missing" in message


def test_a_damaged_manifest_is_reported_as_such(tmp_path):
    step_dir = _save(CheckpointManager(tmp_path), 1)
    manifest = step_dir / MANIFEST_FILE
    manifest.write_text(manifest.read_text().replace('"size": 40000', '"size": 40001'))
    health = check_checkpoint(step_dir)
    assert health.state == "damaged"
    assert health.describe() == f"{MANIFEST_FILE} its file list does not match its own checksum"
    manifest.write_text("{not json")
    assert "cannot be read (JSONDecodeError" in check_checkpoint(step_dir).describe()


def test_a_checkpoint_without_manifest_loads_with_a_note(tmp_path, capsys):
    manager = CheckpointManager(tmp_path)
    step_dir = _save(manager, 1)
    (step_dir / MANIFEST_FILE).unlink()  # as written by rlcli before manifests
    assert manager.resolve_resume(step_dir) == step_dir
    assert manager.resolve_resume("auto") == step_dir
    printed = capsys.readouterr().out
    assert printed.count(f"checkpoint {step_dir} has no {MANIFEST_FILE}") == 2
    assert "cannot be verified; loading it as is" in printed


def test_keep_last_does_not_count_a_damaged_checkpoint(tmp_path, capsys):
    manager = CheckpointManager(tmp_path, keep_last=2)
    _save(manager, 1)
    _truncate_shard(_save(manager, 2))
    _save(manager, 3)
    # Plain pruning would have deleted step 1, leaving one intact checkpoint.
    assert complete_steps(manager) == [1, 2, 3]
    assert "kept, but not counted toward checkpoint.keep_last" in capsys.readouterr().out
    _save(manager, 4)  # two intact checkpoints newer than the damaged one: it goes
    assert complete_steps(manager) == [3, 4]


def test_hashing_shares_cover_every_file_once_and_balance_bytes():
    sizes = {f"f{i}": size for i, size in enumerate([100, 60, 50, 40, 10, 10, 5])}
    shares = [share_of_files(sizes, rank, 3) for rank in range(3)]
    assert sorted(name for share in shares for name in share) == sorted(sizes)
    loads = [sum(sizes[name] for name in share) for share in shares]
    assert max(loads) - min(loads) <= max(sizes.values())
    assert share_of_files(sizes, 0, 1) == sorted(sizes, key=lambda name: -sizes[name])


def test_at_save_time_each_rank_hashes_the_shards_it_wrote():
    names = ["model/__0_0.distcp", "model/__1_0.distcp", "model/__1_1.distcp", "model/common.pt"]
    writers = shard_writers([*names, "model/.metadata"])
    assert writers == {names[0]: 0, names[1]: 1, names[2]: 1}
    sizes = {name: 100 for name in names}
    assert share_of_files(sizes, 0, 2, writers) == [names[0], names[3]]  # the lighter rank
    assert share_of_files(sizes, 1, 2, writers) == [names[1], names[2]]
    # Written by rank 3 of a larger world: shared out like any other file.
    assert share_of_files({"__3_0.distcp": 5}, 1, 2, {"__3_0.distcp": 3}) == []


def _two_rank_check(rank: int, root: Path, init_file: Path) -> None:
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2
    )
    try:
        manager = CheckpointManager(root)
        with manager.saving(1, subdirs=("model",)) as directory:
            (directory / "model" / f"__{rank}_0.distcp").write_bytes(os.urandom(1 << 16))
        step_dir = manager.step_dir(1)
        assert manager.check(step_dir).state == "intact"
        torch.distributed.barrier()
        if rank == 0:
            _flip_last_byte(step_dir / "model" / "__1_0.distcp")
        torch.distributed.barrier()
        # Each rank hashes a share; both must see the damage, whichever rank found it.
        with pytest.raises(UserError, match=r"model/__1_0\.distcp has CRC-32"):
            manager.resolve_resume(step_dir)
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.dist
def test_two_ranks_share_the_hashing_and_agree(tmp_path):
    root = tmp_path / "ckpt"
    torch.multiprocessing.spawn(_two_rank_check, args=(root, tmp_path / "init"), nprocs=2)
    manifest = json.loads((root / "step_000001" / MANIFEST_FILE).read_text())
    assert [entry["path"] for entry in manifest["files"]] == [
        "model/__0_0.distcp",
        "model/__1_0.distcp",
    ]


def _verify(directory: Path, capsys) -> tuple[int, str, str]:
    """``rlcli checkpoint verify DIRECTORY`` through the console entry point: exit code, stdout,
    stderr."""
    with pytest.raises(SystemExit) as exit_:
        main(["checkpoint", "verify", str(directory)])
    captured = capsys.readouterr()
    return exit_.value.code, captured.out, captured.err


def test_checkpoint_verify_lists_each_state_and_exits_with_its_code(tmp_path, capsys):
    manager = CheckpointManager(tmp_path)
    old, intact, damaged = _save(manager, 1), _save(manager, 2), _save(manager, 3)
    (old / MANIFEST_FILE).unlink()
    _truncate_shard(damaged)
    (tmp_path / ".tmp-step_000004").mkdir()  # an interrupted save

    code, out, err = _verify(tmp_path, capsys)
    assert code == 1, out + err
    lines = out.splitlines()
    assert lines[0].startswith(f"{damaged}  damaged") and f"{SHARD} is 100 bytes" in lines[0]
    assert lines[1].startswith(f"{intact}  intact") and "sizes and checksums match" in lines[1]
    assert lines[2].startswith(f"{old}  unverifiable")
    assert lines[3].startswith(f"{tmp_path / '.tmp-step_000004'}  incomplete")
    assert lines[4] == (
        "3 checkpoints: 1 intact, 1 damaged, 1 unverifiable; trainer.resume=auto takes step_000002"
    )
    assert _verify(intact, capsys)[0] == 0
    assert _verify(old, capsys)[0] == 3
    assert _verify(damaged, capsys)[0] == 1
    code, _, err = _verify(tmp_path / "nothing-here", capsys)
    assert code == 2 and "no checkpoints there" in err


def test_export_refuses_a_damaged_checkpoint(tmp_path, capsys):
    damaged = _save(CheckpointManager(tmp_path), 1)
    _delete_shard(damaged)
    with pytest.raises(SystemExit) as exit_:
        main(["export", str(damaged), "--out", str(tmp_path / "hf")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    assert f"{damaged}: the checkpoint is damaged: {SHARD} is missing" in err
    assert not (tmp_path / "hf").exists()
