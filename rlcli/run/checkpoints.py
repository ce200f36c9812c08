"""Run-level checkpoints: directories that are either complete and intact or ignored, and the
choice of the one to resume from (what a run writes into them is ``rlcli.train.save_resume``; the
sharded model and optimizer I/O itself is ``parallel.checkpoint``; the trainer's own state and
RNGs are ``rlcli.run.state``; the manifest is ``rlcli.run.manifest``).

Layout under the checkpoint root::

    step_000010/            a committed checkpoint: has the COMPLETE marker
        COMPLETE
        MANIFEST.json       every other file with its size and CRC-32
        trainer_state.json
        rng_state_rank0.safetensors, rng_state_rank1.safetensors, ...
        ...                 whatever the trainer wrote (e.g. megatron dist_checkpointing shards)
    .tmp-step_000020/       a save in progress (or one that crashed): never loaded
    latest                  text file naming the most recently committed step directory

A save writes everything into ``.tmp-step_N``; after every rank finished writing, the ranks hash
the files (each a share) and rank 0 writes the manifest, each node fsyncs the files, then rank 0
adds the marker and renames the directory to ``step_N`` in one ``os.replace``. A crash at any
point leaves either no ``step_N`` or a complete one with its manifest. Saving a step that already
has a checkpoint (a resumed run redoing it) first renames the old one to ``.replaced-step_N``,
which still counts as step N's checkpoint until the new one is in place, so a commit never leaves
fewer complete checkpoints than there were. Pruning renames a directory away before deleting it,
so a half-deleted checkpoint never looks complete either.

Damage after the commit (a disk or copy fault) is caught by the manifest: an explicit
``trainer.resume=DIR`` that is damaged is a user error naming the file and what differs; ``auto``
and torchrun restarts skip damaged checkpoints (saying so) for the newest intact one; pruning does
not count damaged checkpoints (a ``stat`` per file finds missing and truncated ones) toward
``keep_last``. Checkpoints without a manifest (older rlcli) load with a note.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from rlcli.errors import UserError
from rlcli.run.manifest import (
    AllGather,
    CheckpointHealth,
    check_checkpoint,
    write_manifest,
)
from rlcli.run.state import TEMPORARY_PREFIX, distributed_rank, write_text_atomically

COMPLETE_MARKER = "COMPLETE"
LATEST_POINTER = "latest"
DELETING_PREFIX = ".deleting-"
REPLACED_PREFIX = ".replaced-"
_STEP_DIR_RE = re.compile(r"^step_(\d+)$")


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def is_complete_checkpoint(path: str | os.PathLike[str]) -> bool:
    """True for a ``step_N`` directory that carries the COMPLETE marker."""
    path = Path(path)
    return (
        path.is_dir()
        and _STEP_DIR_RE.match(path.name) is not None
        and (path / COMPLETE_MARKER).is_file()
    )


def checkpoint_step(path: str | os.PathLike[str]) -> int:
    """The step number of a ``step_N`` directory."""
    match = _STEP_DIR_RE.match(Path(path).name)
    if match is None:
        raise ValueError(f"{path} is not a step_N checkpoint directory")
    return int(match.group(1))


def _fsync_dir(path: Path) -> None:
    # Makes a rename durable: the directory entry itself must reach the disk.
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _fsync_tree(path: Path) -> None:
    """Flush every file under ``path`` to disk (a marker must never reach the disk before the
    data it vouches for)."""
    for folder, _, files in os.walk(path):
        for name in files:
            descriptor = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(descriptor)
            finally:
                os.close(descriptor)
        _fsync_dir(Path(folder))


def _distributed_barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def _distributed_all_gather(obj: Any) -> list[Any]:
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [obj]
    gathered: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, obj)
    return gathered


def _distributed_world_size() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


class CheckpointManager:
    """Creates, checks, finds and prunes ``step_N`` checkpoint directories under ``root_dir``.

    Every rank constructs one and enters :meth:`saving` and :meth:`resolve_resume` together
    (they are collectives: the ranks share the hashing).

    Args:
        root_dir: the checkpoint root (shared by all ranks, e.g. on a network filesystem).
        keep_last: how many intact checkpoints to keep; ``None`` keeps all.
        rank: this process's global rank (default: from torch.distributed, else 0).
        barrier: waits for every rank (default: ``torch.distributed.barrier`` when initialised,
            else nothing).
        world_size, all_gather: the ranks that share the hashing and how they exchange results
            (default: torch.distributed's world and ``all_gather_object`` when initialised, else
            this process alone).
    """

    def __init__(
        self,
        root_dir: str | os.PathLike[str],
        keep_last: int | None = None,
        rank: int | None = None,
        barrier: Callable[[], None] | None = None,
        world_size: int | None = None,
        all_gather: AllGather | None = None,
    ) -> None:
        if keep_last is not None and keep_last < 1:
            raise UserError(
                f"checkpoint keep_last must be at least 1 (or null to keep all), got {keep_last}."
            )
        self.root_dir = Path(root_dir)
        self.keep_last = keep_last
        self.rank = distributed_rank() if rank is None else rank
        self.world_size = _distributed_world_size() if world_size is None else world_size
        # A rank given without its world (tools, tests) hashes every file itself.
        self._hash_rank = self.rank if self.world_size > 1 else 0
        self._barrier = barrier or _distributed_barrier
        self._all_gather = all_gather or _distributed_all_gather

    def check(self, path: str | os.PathLike[str], checksums: bool = True) -> CheckpointHealth:
        """Collective: ``path`` against its manifest, the hashing spread over the ranks."""
        return check_checkpoint(
            path,
            checksums,
            rank=self._hash_rank,
            world_size=self.world_size,
            all_gather=self._all_gather,
        )

    def step_dir(self, step: int) -> Path:
        """Where the complete checkpoint of ``step`` lives (whether or not it exists)."""
        return self.root_dir / step_dir_name(step)

    def complete_dirs(self) -> list[Path]:
        """Every complete checkpoint directory, the most recently committed first."""
        return [path for _, _, path in reversed(self._commit_order())]

    def _commit_order(self) -> list[tuple[int, int, Path]]:
        """``(commit sequence, step, directory)`` of every complete checkpoint, oldest commit
        first. A ``.replaced-step_N`` (a re-save of step N was interrupted) stands in for
        ``step_N`` while that is missing."""
        if not self.root_dir.is_dir():
            return []
        committed = {}
        replaced = {}
        for path in self.root_dir.iterdir():
            if is_complete_checkpoint(path):
                committed[checkpoint_step(path)] = path
            elif path.name.startswith(REPLACED_PREFIX):
                original = path.with_name(path.name[len(REPLACED_PREFIX) :])
                if _STEP_DIR_RE.match(original.name) and (path / COMPLETE_MARKER).is_file():
                    replaced[checkpoint_step(original)] = path
        for step, path in replaced.items():
            committed.setdefault(step, path)
        return sorted((_commit_sequence(path), step, path) for step, path in committed.items())

    def latest_dir(self) -> Path | None:
        """The most recently committed complete checkpoint (``None``: there is none).

        Usually the highest step; but after a run resumed from an older checkpoint, its own new
        checkpoints count as latest, not those the abandoned run had written beyond them.
        """
        order = self._commit_order()
        return order[-1][2] if order else None

    @contextmanager
    def saving(self, step: int, subdirs: Sequence[str] = ()) -> Iterator[Path]:
        """Collective: yields a temporary directory for every rank to write ``step`` into.

        ``subdirs`` are created (by rank 0, before every rank may write) for writers that need an
        existing, empty folder, such as megatron-core's ``dist_checkpointing.save``.

        On normal exit, after a barrier, the ranks hash the files for the manifest, then rank 0
        marks it complete, renames it to ``step_N``, updates ``latest`` and prunes old
        checkpoints; a final barrier keeps other ranks from reading before that. On an exception
        nothing is committed and the exception propagates (the leftover temporary directory is
        removed by the next save).
        """
        temporary = self.root_dir / f"{TEMPORARY_PREFIX}{step_dir_name(step)}"
        if self.rank == 0:
            self.root_dir.mkdir(parents=True, exist_ok=True)
            self._remove_leftovers()
            temporary.mkdir()
            for subdir in subdirs:
                (temporary / subdir).mkdir(parents=True)
        self._barrier()
        yield temporary
        self._barrier()
        write_manifest(
            temporary,
            rank=self._hash_rank,
            world_size=self.world_size,
            all_gather=self._all_gather,
        )
        self._barrier()  # the manifest is in place (no temporary file of it) before the walk
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # once per node: its ranks' files
            _fsync_tree(temporary)
        self._barrier()
        if self.rank == 0:
            self._commit(temporary, step)
        self._barrier()

    def _commit(self, temporary: Path, step: int) -> None:
        order = self._commit_order()
        sequence = order[-1][0] + 1 if order else 1
        marker = json.dumps({"step": step, "sequence": sequence}) + "\n"
        write_text_atomically(temporary / COMPLETE_MARKER, marker)
        _fsync_dir(temporary)
        final = self.step_dir(step)
        replaced = final.with_name(f"{REPLACED_PREFIX}{final.name}")
        if final.exists():
            # Saving a step again (a resumed run redoing it): the old copy steps aside, still
            # complete, until the new one is in place.
            if replaced.exists():
                shutil.rmtree(replaced)
            os.replace(final, replaced)
        os.replace(temporary, final)
        _fsync_dir(self.root_dir)
        write_text_atomically(self.root_dir / LATEST_POINTER, final.name + "\n")
        if replaced.exists():
            self._delete(replaced)
        self._prune()

    def _prune(self) -> None:
        if self.keep_last is None:
            return
        # Newest commits are kept first, so a resumed run's new checkpoints outlive an abandoned
        # run's. A damaged checkpoint does not take the place of an intact one: it is kept (for
        # inspection or repair) without counting, until keep_last newer intact ones exist.
        kept = 0
        for path in self.complete_dirs():
            if kept == self.keep_last:
                self._delete(path)
                continue
            health = check_checkpoint(path, checksums=False)  # rank 0 alone: a stat per file
            if health.loadable:
                kept += 1
            else:
                self._say(
                    f"checkpoint {path} is damaged ({health.describe()}): kept, but not counted "
                    "toward checkpoint.keep_last"
                )

    def _delete(self, path: Path) -> None:
        # Renamed away first: a crash half-way through rmtree must not leave a marked directory.
        doomed = path.with_name(f"{DELETING_PREFIX}{path.name}")
        os.replace(path, doomed)
        shutil.rmtree(doomed)

    def _remove_leftovers(self) -> None:
        for path in self.root_dir.iterdir():
            if path.is_dir() and path.name.startswith((TEMPORARY_PREFIX, DELETING_PREFIX)):
                shutil.rmtree(path)
            elif path.is_dir() and path.name.startswith(REPLACED_PREFIX):
                original = path.with_name(path.name[len(REPLACED_PREFIX) :])
                if is_complete_checkpoint(original):  # else it is still a step's only copy
                    shutil.rmtree(path)

    def resolve_resume(
        self, resume: str | os.PathLike[str] | None, restarted: bool = False
    ) -> Path | None:
        """Collective: the checkpoint to resume from for ``trainer.resume`` (``"auto"``,
        ``"none"`` or a path), checked against its manifest.

        ``auto`` takes the newest intact checkpoint under the root, skipping damaged ones with a
        note (``None`` when there is none: a fresh start); ``none`` (or ``None``) never resumes;
        a path must be a complete ``step_N`` checkpoint directory that is not damaged.
        ``restarted`` (torchrun restarted the group after a rank died) continues from this run's
        newest intact checkpoint whatever ``resume`` named for the first start. A checkpoint
        without a manifest is taken with a note that it cannot be verified.
        """
        if restarted and self.latest_dir() is not None:
            return self._newest_loadable("torchrun restarted the group")
        if resume is None or str(resume).lower() in ("none", "null", ""):
            return None
        if str(resume).lower() == "auto":
            return self._newest_loadable("trainer.resume=auto")
        path = Path(resume)
        if not is_complete_checkpoint(path):
            raise UserError(_why_not_a_checkpoint(path))
        health = self.check(path)
        if not health.loadable:
            raise UserError(
                f"trainer.resume={str(path)!r}: the checkpoint is damaged: {health.describe()}. "
                f"Resume from an intact one (`rlcli checkpoint verify {path.parent}` lists them; "
                "trainer.resume=auto takes the newest) or restore the file."
            )
        self._note_unverifiable(health)
        return path

    def _newest_loadable(self, reason: str) -> Path | None:
        damaged: list[CheckpointHealth] = []
        for path in self.complete_dirs():
            health = self.check(path)
            if not health.loadable:
                damaged.append(health)
                self._say(f"{reason}: skipping damaged checkpoint {path}: {health.describe()}")
                continue
            if damaged:
                self._say(f"{reason}: resuming from {path}, the newest intact checkpoint")
            self._note_unverifiable(health)
            return path
        if not damaged:
            return None
        raise UserError(
            f"{reason}: every checkpoint under {self.root_dir} is damaged ("
            + "; ".join(f"{health.directory.name}: {health.describe(1)}" for health in damaged)
            + "). Restore the files, or set trainer.resume=none to start over."
        )

    def _note_unverifiable(self, health: CheckpointHealth) -> None:
        if health.state == "unverifiable":
            self._say(f"checkpoint {health.directory} has {health.describe()}; loading it as is")

    def _say(self, message: str) -> None:
        if self.rank == 0:
            print(f"[rlcli] {message}", flush=True)


def _commit_sequence(path: Path) -> int:
    """Order of commit recorded in the COMPLETE marker (0 for markers without one)."""
    try:
        return int(json.loads((path / COMPLETE_MARKER).read_text()).get("sequence", 0))
    except (ValueError, AttributeError):
        return 0


def _why_not_a_checkpoint(path: Path) -> str:
    prefix = f"trainer.resume={str(path)!r}"
    choices = "use 'auto' (newest intact checkpoint), 'none', or a step_N checkpoint directory"
    if not path.exists():
        return f"{prefix}: no such directory; {choices}."
    if not path.is_dir():
        return f"{prefix} is a file, not a checkpoint directory; {choices}."
    if _STEP_DIR_RE.match(path.name) is None:
        inside = CheckpointManager(path, rank=0).latest_dir()
        hint = f" (its newest complete checkpoint is {inside})" if inside is not None else ""
        return f"{prefix} is not a step_N checkpoint directory{hint}; {choices}."
    return (
        f"{prefix} has no {COMPLETE_MARKER} marker: the save was interrupted and the checkpoint "
        f"is incomplete; {choices}."
    )


def checkpoint_root(checkpoint_dir: str | None, output_dir: str) -> str:
    return checkpoint_dir or os.path.join(output_dir, "checkpoints")
