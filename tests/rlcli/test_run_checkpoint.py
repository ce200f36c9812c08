import json
import os
import random

import numpy as np
import pytest
import torch
from safetensors import safe_open

from rlcli.errors import UserError
from rlcli.run.checkpoints import CheckpointManager
from rlcli.run.state import RunState, load_run_state, rng_state_file, save_run_state
from tests.rlcli.checkpoint_steps import complete_steps, latest_step


def _save(manager, step, payload="weights"):
    with manager.saving(step) as directory:
        (directory / "model.bin").write_text(f"{payload} {step}")
    return manager.step_dir(step)


def test_saving_commits_a_complete_directory_and_latest_pointer(tmp_path):
    manager = CheckpointManager(tmp_path)
    with manager.saving(10) as directory:
        assert directory == tmp_path / ".tmp-step_000010"
        assert latest_step(manager) is None  # not visible while it is being written
        (directory / "model.bin").write_text("w")
    final = tmp_path / "step_000010"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000010"]
    assert (final / "model.bin").read_text() == "w"
    assert json.loads((final / "COMPLETE").read_text()) == {"step": 10, "sequence": 1}
    assert (tmp_path / "latest").read_text().strip() == "step_000010"
    assert latest_step(manager) == 10 and manager.latest_dir() == final


def test_a_crash_inside_saving_leaves_no_complete_checkpoint(tmp_path):
    manager = CheckpointManager(tmp_path)
    _save(manager, 10)
    with pytest.raises(RuntimeError, match="disk full"), manager.saving(20) as directory:
        (directory / "model.bin").write_text("half")
        raise RuntimeError("disk full")
    assert not (tmp_path / "step_000020").exists()
    assert latest_step(manager) == 10
    assert manager.resolve_resume("auto") == tmp_path / "step_000010"
    assert (tmp_path / "latest").read_text().strip() == "step_000010"
    # The next save clears the leftover temporary directory.
    _save(manager, 30)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000010", "step_000030"]


def test_half_written_directories_are_never_loaded(tmp_path):
    manager = CheckpointManager(tmp_path)
    _save(manager, 10)
    # A step directory without marker (copied by hand, or written by another tool and cut
    # short) and a temporary directory that even has a marker.
    (tmp_path / "step_000030").mkdir()
    (tmp_path / "step_000030" / "model.bin").write_text("half")
    (tmp_path / ".tmp-step_000040").mkdir()
    (tmp_path / ".tmp-step_000040" / "COMPLETE").write_text("{}")
    assert complete_steps(manager) == [10]
    assert manager.resolve_resume("auto") == tmp_path / "step_000010"
    with pytest.raises(UserError, match=r"trainer\.resume.*no COMPLETE marker.*incomplete"):
        manager.resolve_resume(tmp_path / "step_000030")
    with pytest.raises(UserError, match=r"trainer\.resume.*not a step_N"):
        manager.resolve_resume(tmp_path / ".tmp-step_000040")


def test_keep_last_prunes_oldest_complete_checkpoints(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2)
    for step in (10, 20, 30, 40, 50):
        _save(manager, step)
    assert complete_steps(manager) == [40, 50]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000040", "step_000050"]


def test_after_resuming_an_older_checkpoint_its_new_saves_are_latest(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=3)
    for step in (10, 20, 30):
        _save(manager, step)
    # The user resumes from step 10 (say, before a loss spike) and saves step 11.
    assert manager.resolve_resume(tmp_path / "step_000010") == tmp_path / "step_000010"
    _save(manager, 11)
    # A crash now and `trainer.resume: auto` must continue at 11, not jump to the old 30.
    assert latest_step(manager) == 11
    assert (tmp_path / "latest").read_text().strip() == "step_000011"
    _save(manager, 12)
    _save(manager, 13)
    # Pruning drops the oldest commits, the abandoned 20 and 30 included.
    assert complete_steps(manager) == [11, 12, 13]


def test_saving_the_same_step_again_replaces_it(tmp_path):
    manager = CheckpointManager(tmp_path)
    _save(manager, 10, payload="first")
    _save(manager, 10, payload="second")
    assert (tmp_path / "step_000010" / "model.bin").read_text() == "second 10"
    assert complete_steps(manager) == [10]


def test_resolve_resume_choices_and_errors(tmp_path):
    manager = CheckpointManager(tmp_path / "ckpt")
    assert manager.resolve_resume("auto") is None  # nothing saved yet: fresh start
    final = _save(manager, 5)
    assert manager.resolve_resume("none") is None
    assert manager.resolve_resume(None) is None
    assert manager.resolve_resume(str(final)) == final
    with pytest.raises(UserError, match="no such directory"):
        manager.resolve_resume(tmp_path / "missing")
    with pytest.raises(
        UserError, match=r"not a step_N.*newest complete checkpoint is .*step_000005"
    ):
        manager.resolve_resume(tmp_path / "ckpt")
    with pytest.raises(UserError, match="keep_last"):
        CheckpointManager(tmp_path, keep_last=0)


def _draw_numbers():
    return (
        [random.random() for _ in range(3)],
        [random.gauss(0, 1)],  # python's gauss caches a second value: part of the state
        np.random.rand(3).tolist(),
        torch.rand(3).tolist(),
    )


def test_run_state_and_rng_round_trip_without_pickle(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.gauss(0, 1)  # leaves a cached gaussian in python's state
    state = RunState(step=7, loader={"epoch": 1, "position": 96}, kl_coef=0.05)
    save_run_state(tmp_path, state, rank=0)
    expected = _draw_numbers()
    _draw_numbers()  # move every generator on
    assert load_run_state(tmp_path, rank=0) == state
    assert _draw_numbers() == expected
    # RNG states are plain tensors in safetensors, not pickles.
    with safe_open(str(tmp_path / rng_state_file(0)), framework="pt") as handle:
        assert set(handle.keys()) >= {"python", "numpy", "torch_cpu"}


def test_rng_states_are_per_rank(tmp_path):
    torch.manual_seed(0)
    save_run_state(tmp_path, RunState(step=1), rank=0)
    rank0_draw = torch.rand(2)
    torch.manual_seed(1)
    save_run_state(tmp_path, RunState(step=999), rank=1)  # only rank 0 writes the JSON
    rank1_draw = torch.rand(2)
    assert load_run_state(tmp_path, rank=1) == RunState(step=1)
    assert torch.equal(torch.rand(2), rank1_draw)
    load_run_state(tmp_path, rank=0)
    assert torch.equal(torch.rand(2), rank0_draw)
    with pytest.warns(RuntimeWarning, match="rng_state_rank2"):
        load_run_state(tmp_path, rank=2)


def test_loading_a_directory_without_trainer_state_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="trainer_state.json is missing"):
        load_run_state(tmp_path, rank=0)


def test_run_state_file_is_versioned_and_checked(tmp_path):
    state = RunState(step=3, loader={"epoch": 0, "position": 12}, kl_coef=0.1, model_dir="m")
    assert state.to_dict() == {
        "version": 2,
        "step": 3,
        "loader": {"epoch": 0, "position": 12},
        "kl_coef": 0.1,
        "model_dir": "m",
    }
    assert RunState.from_dict(state.to_dict(), "x") == state
    # written before the version field: version 1
    assert RunState.from_dict({"step": 2, "history": []}, "x") == RunState(step=2, history=[])
    # a version 1 file (before `settings`) reads as it was written
    assert RunState.from_dict({"version": 1, "step": 4}, "x") == RunState(step=4)
    with pytest.raises(UserError, match="f.json: run state version 3, this rlcli reads up to 2"):
        RunState.from_dict({"version": 3, "step": 1}, "f.json")
    with pytest.raises(UserError, match=r"f.json is not an rlcli run state \(unknown keys \['x'\]"):
        RunState.from_dict({"step": 1, "x": 0}, "f.json")
    with pytest.raises(UserError, match="no 'step'"):
        RunState.from_dict({"kl_coef": 0.1}, "f.json")


def _two_rank_save(rank, root, init_file):
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2
    )
    try:
        manager = CheckpointManager(root, keep_last=1)
        for step in (1, 2):
            with manager.saving(step, subdirs=("model",)) as directory:
                # Every rank writes its own shard, as megatron dist_checkpointing does.
                (directory / "model" / f"shard_rank{rank}.bin").write_bytes(os.urandom(1 << 16))
                save_run_state(directory, RunState(step=step))
            # After the context every rank sees the committed checkpoint.
            assert latest_step(manager) == step
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.dist
def test_two_ranks_commit_only_after_both_wrote(tmp_path):
    root = tmp_path / "ckpt"
    torch.multiprocessing.spawn(_two_rank_save, args=(root, tmp_path / "init"), nprocs=2, join=True)
    final = root / "step_000002"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000002"]
    assert sorted(p.name for p in final.iterdir()) == [
        "COMPLETE",
        "MANIFEST.json",
        "model",
        "rng_state_rank0.safetensors",
        "rng_state_rank1.safetensors",
        "trainer_state.json",
    ]
    assert sorted(p.name for p in (final / "model").iterdir()) == [
        "shard_rank0.bin",
        "shard_rank1.bin",
    ]


def test_resaving_a_step_never_leaves_fewer_complete_checkpoints(tmp_path, monkeypatch):
    """keep_last=1 and a re-save of the only step: at every moment of the commit one complete
    copy of step 10 exists, and a crash between the two renames keeps the old copy usable."""
    manager = CheckpointManager(tmp_path, keep_last=1)
    _save(manager, 10, "old")
    seen = []
    real_replace = os.replace

    def watching_replace(src, dst):
        real_replace(src, dst)
        seen.append(complete_steps(CheckpointManager(tmp_path, rank=0)))

    monkeypatch.setattr(os, "replace", watching_replace)
    _save(manager, 10, "new")
    monkeypatch.setattr(os, "replace", real_replace)
    assert all(steps == [10] for steps in seen), seen
    assert (tmp_path / "step_000010" / "model.bin").read_text() == "new 10"
    assert not (tmp_path / ".replaced-step_000010").exists()

    # A crash right after the old copy stepped aside: it still counts, and resume finds it.
    real_replace(tmp_path / "step_000010", tmp_path / ".replaced-step_000010")
    assert complete_steps(manager) == [10]
    assert manager.resolve_resume("auto") == tmp_path / ".replaced-step_000010"
    _save(manager, 11, "next")  # the next save neither loses it early nor keeps it forever
    assert complete_steps(manager) == [11]
    assert not (tmp_path / ".replaced-step_000010").exists()
