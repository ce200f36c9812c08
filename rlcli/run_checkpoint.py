"""Run-level checkpoints: directories that are either complete or ignored, and saving / resuming
a run (the sharded model and optimizer I/O itself is ``parallel.checkpoint``; the trainer's own
state and RNGs are ``rlcli.run_state``).

Layout under the checkpoint root::

    step_000010/            a complete checkpoint: has the COMPLETE marker
        COMPLETE
        trainer_state.json
        rng_state_rank0.safetensors, rng_state_rank1.safetensors, ...
        ...                 whatever the trainer wrote (e.g. megatron dist_checkpointing shards)
    .tmp-step_000020/       a save in progress (or one that crashed): never loaded
    latest                  text file naming the most recently committed step directory

A run's checkpoint (``save_run``) holds ``model/`` (megatron dist_checkpointing: model, optimizer,
scheduler), ``hf/`` (config and tokenizer, so it converts to HF on its own) and the trainer state
(step, data position, KL coefficient, RNG states). A LoRA actor's ``model/`` holds only its
adapters and their optimizer state; the base is the run's HF model (``rlcli.lora``). A PPO run adds ``critic/model/`` (the value
model, its optimizer and scheduler, same format) and ``critic/hf/`` (the config and tokenizer the
critic was built from; ``rlcli export --critic`` turns the two into an HF model).

A save writes everything into ``.tmp-step_N``; after every rank finished writing, each node
fsyncs the files, then rank 0 adds the marker and renames the directory to ``step_N`` in one
``os.replace``. A crash at any point leaves either no ``step_N`` or a complete one. Saving a step
that already has a checkpoint (a resumed run redoing it) first renames the old one to
``.replaced-step_N``, which still counts as step N's checkpoint until the new one is in place,
so a commit never leaves fewer complete checkpoints than there were. Pruning renames a directory
away before deleting it, so a half-deleted checkpoint never looks complete either.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rlcli.errors import UserError
from rlcli.run_state import (
    TEMPORARY_PREFIX,
    distributed_rank,
    load_trainer_state,
    save_trainer_state,
    write_text_atomically,
)

if TYPE_CHECKING:  # the model pulls in megatron; `rlcli export` only needs the directory rules
    from rlcli.trained_model import TrainedModel

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


class CheckpointManager:
    """Creates, finds and prunes ``step_N`` checkpoint directories under ``root_dir``.

    Every rank constructs one and enters :meth:`saving` together (it is a collective).

    Args:
        root_dir: the checkpoint root (shared by all ranks, e.g. on a network filesystem).
        keep_last: how many complete checkpoints to keep; ``None`` keeps all.
        rank: this process's global rank (default: from torch.distributed, else 0).
        barrier: waits for every rank (default: ``torch.distributed.barrier`` when initialised,
            else nothing).
    """

    def __init__(
        self,
        root_dir: str | os.PathLike[str],
        keep_last: int | None = None,
        rank: int | None = None,
        barrier: Callable[[], None] | None = None,
    ) -> None:
        if keep_last is not None and keep_last < 1:
            raise UserError(
                f"checkpoint keep_last must be at least 1 (or null to keep all), got {keep_last}."
            )
        self.root_dir = Path(root_dir)
        self.keep_last = keep_last
        self.rank = distributed_rank() if rank is None else rank
        self._barrier = barrier or _distributed_barrier

    def step_dir(self, step: int) -> Path:
        """Where the complete checkpoint of ``step`` lives (whether or not it exists)."""
        return self.root_dir / step_dir_name(step)

    def complete_steps(self) -> list[int]:
        """Steps with a complete checkpoint, ascending."""
        return sorted(step for _, step, _ in self._commit_order())

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

    def latest_step(self) -> int | None:
        """The step of the most recently committed complete checkpoint (``None``: there is none).

        Usually the highest step; but after a run resumed from an older checkpoint, its own new
        checkpoints count as latest, not those the abandoned run had written beyond them.
        """
        order = self._commit_order()
        return order[-1][1] if order else None

    def latest_dir(self) -> Path | None:
        order = self._commit_order()
        return order[-1][2] if order else None

    @contextmanager
    def saving(self, step: int, subdirs: Sequence[str] = ()) -> Iterator[Path]:
        """Collective: yields a temporary directory for every rank to write ``step`` into.

        ``subdirs`` are created (by rank 0, before every rank may write) for writers that need an
        existing, empty folder, such as megatron-core's ``dist_checkpointing.save``.

        On normal exit, after a barrier, rank 0 marks it complete, renames it to ``step_N``,
        updates ``latest`` and prunes old checkpoints; a final barrier keeps other ranks from
        reading before that. On an exception nothing is committed and the exception propagates
        (the leftover temporary directory is removed by the next save).
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
        # Oldest commits go first, so a resumed run's new checkpoints outlive an abandoned run's.
        for _, _, path in self._commit_order()[: -self.keep_last]:
            self._delete(path)

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

    def resolve_resume(self, resume: str | os.PathLike[str] | None) -> Path | None:
        """The checkpoint to resume from for ``trainer.resume``: ``"auto"``, ``"none"`` or a path.

        ``auto`` takes the newest complete checkpoint under the root (``None`` when there is
        none: a fresh start); ``none`` (or ``None``) never resumes; a path must be a complete
        ``step_N`` checkpoint directory.
        """
        if resume is None or str(resume).lower() in ("none", "null", ""):
            return None
        if str(resume).lower() == "auto":
            return self.latest_dir()
        path = Path(resume)
        if is_complete_checkpoint(path):
            return path
        raise UserError(_why_not_a_checkpoint(path))


def _commit_sequence(path: Path) -> int:
    """Order of commit recorded in the COMPLETE marker (0 for markers without one)."""
    try:
        return int(json.loads((path / COMPLETE_MARKER).read_text()).get("sequence", 0))
    except (ValueError, AttributeError):
        return 0


def _why_not_a_checkpoint(path: Path) -> str:
    prefix = f"trainer.resume={str(path)!r}"
    choices = "use 'auto' (newest complete checkpoint), 'none', or a step_N checkpoint directory"
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


def save_run(
    ckpt: CheckpointManager,
    step: int,
    actor: TrainedModel,
    model_dir: str,
    state: Mapping[str, Any],
    save_optimizer: bool,
    critic: TrainedModel | None = None,
) -> None:
    """Collective: commit ``step``'s checkpoint (model, optimizer, HF metadata, trainer state;
    the critic's model and optimizer under ``critic/`` when there is one). Every kind of state
    of both must be on the device (the trainer's ``checkpoint`` residency)."""
    from parallel.checkpoint import save_checkpoint
    from parallel.optim import all_weights_finite

    # Collective. A non-finite weight must never reach a checkpoint (pruning would then delete
    # the good ones it replaces).
    if not all_weights_finite([*actor.models, *(critic.models if critic is not None else [])]):
        raise UserError(
            f"step {step}: the actor's or critic's weights are not finite; not saving a checkpoint (the newest "
            f"good one is {ckpt.latest_dir() or 'none'}). Lower actor.lr, keep actor.grad_clip > "
            "0, or use model.dtype=float32 / bfloat16 instead of float16."
        )
    subdirs = ("model", "critic/model") if critic is not None else ("model",)
    with ckpt.saving(step, subdirs=subdirs) as directory:
        save_checkpoint(
            directory / "model",
            actor.models,
            actor.mesh,
            optimizer=actor.optimizer if save_optimizer else None,
            scheduler=actor.scheduler,
            adapters_only=actor.lora is not None,
        )
        if actor.mesh.rank == 0:
            copy_hf_metadata(model_dir, directory / "hf")
        if critic is not None:
            save_checkpoint(
                directory / "critic" / "model",
                critic.models,
                critic.mesh,
                optimizer=critic.optimizer if save_optimizer else None,
                scheduler=critic.scheduler,
            )
            if critic.mesh.rank == 0:
                copy_hf_metadata(critic.hf_dir, directory / "critic" / "hf")
        save_trainer_state(directory, state)


def resume_run(
    ckpt: CheckpointManager,
    resume: str | None,
    actor: TrainedModel,
    load_optimizer: bool,
    critic: TrainedModel | None = None,
) -> dict[str, Any] | None:
    """Load the checkpoint ``trainer.resume`` names into ``actor`` (and ``critic``); its trainer
    state, or None when the run starts fresh."""
    from parallel.checkpoint import load_checkpoint
    from rlcli.lora import check_resumed_lora, lora_state

    path = ckpt.resolve_resume(resume)
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if restarted and ckpt.latest_dir() is not None:
        # torchrun restarted the group after a rank died: continue from this run's newest
        # checkpoint whatever trainer.resume named for the first start.
        path = ckpt.latest_dir()
    if path is None:
        return None
    if critic is not None and not (path / "critic" / "model" / "metadata.json").is_file():
        raise UserError(
            f"trainer.resume: {path} has no critic (critic/model) to resume PPO's value model "
            "from; it was written by a run without algorithm.adv_estimator=gae"
        )
    state = load_trainer_state(path)
    check_resumed_lora(path, state.get("lora"), lora_state(actor.lora))
    for model, folder in ((actor, path / "model"), (critic, path / "critic" / "model")):
        if model is None:
            continue
        changed = load_checkpoint(
            folder,
            model.models,
            model.mesh,
            optimizer=model.optimizer if load_optimizer else None,
            scheduler=model.scheduler,
            adapters_only=model.lora is not None,
        )
        if changed and model.mesh.rank == 0:
            # The current config wins over the checkpoint's hyper-parameters; say what changed.
            print(f"[rlcli] resuming {folder} with the config's values: " + "; ".join(changed))
        if not load_optimizer and model.optimizer is not None:
            from parallel.optim import reload_master_weights

            # bf16 / distributed optimizers keep fp32 master weights; without this the first
            # step writes the pre-resume weights back over the loaded ones.
            reload_master_weights(model.optimizer)
    return state


def copy_hf_metadata(model_dir: str, out: Path) -> None:
    from parallel.convert.hf_io import copy_tokenizer_files

    copy_tokenizer_files(model_dir, out)
    for name in ("config.json", "generation_config.json"):
        if (Path(model_dir) / name).is_file():
            shutil.copy2(Path(model_dir) / name, out / name)


def checkpoint_root(checkpoint_dir: str | None, output_dir: str) -> str:
    return checkpoint_dir or os.path.join(output_dir, "checkpoints")
