"""A training loop's own state in its checkpoint, besides the models: ``RunState`` (step, data
position, KL coefficient, ...; one typed record for ``rlcli train``, ``rlcli rm`` and ``rlcli
sft``), written as JSON by rank 0, and each rank's RNG states (python, numpy, torch CPU and CUDA,
megatron's named streams) as safetensors beside it; the checkpoint folder rules around them are
``rlcli.run.checkpoints``, what a loop saves and resumes ``rlcli.train.save_resume``.

No pickle in what rlcli writes itself. megatron-core's dist-checkpoint metadata (model/.metadata,
common.pt) IS read with pickle / torch.load, so a checkpoint can run code when loaded: load only
checkpoints you (or someone you trust) wrote.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from rlcli.errors import UserError

TRAINER_STATE_FILE = "trainer_state.json"
TEMPORARY_PREFIX = ".tmp-"
# Raised when a field changes meaning; a checkpoint without one (older rlcli) is version 1.
RUN_STATE_VERSION = 2  # 2: settings


@dataclass
class RunState:
    """What a training loop resumes from besides its models and RNGs. Every loop has ``step``;
    each fills its own fields and leaves the others None."""

    step: int = 0  # steps done
    # rlcli train
    loader: dict[str, Any] | None = None  # PromptLoader.state_dict(): epoch, position, seed, ...
    kl_coef: float | None = None  # the KL controller's coefficient
    model_dir: str | None = None  # the HF folder the run trained from (a LoRA actor's base)
    lora: dict[str, Any] | None = (
        None  # the actor's adapters (rlcli.model.lora.lora_state); None: full
    )
    model_rewards: dict[str, Any] | None = None  # ModelRewards.state_dict(): the normaliser
    # the resolved config as dotted keys (rlcli.run.resume_plan compares it on a resume)
    settings: dict[str, Any] | None = None
    # rlcli rm
    history: list[dict[str, Any]] | None = None  # per step: loss, accuracy, grad_norm, lr, ...
    val_accuracy_before: float | None = None  # held-out pairwise accuracy before training
    # rlcli sft (the warm start)
    sampler: dict[str, Any] | None = None  # the pair sampler's numpy bit-generator state

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of ``trainer_state.json``: the version, then every field set."""
        fields = dataclasses.asdict(self)
        return {"version": RUN_STATE_VERSION, **{k: v for k, v in fields.items() if v is not None}}

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str | os.PathLike[str]) -> RunState:
        """The state ``to_dict`` wrote (``source`` names the file in errors)."""
        data = dict(data)
        version = data.pop("version", 1)
        if not isinstance(version, int) or version > RUN_STATE_VERSION:
            raise UserError(
                f"{source}: run state version {version!r}, this rlcli reads up to "
                f"{RUN_STATE_VERSION}: resume it with the rlcli that wrote it, or start over "
                "(trainer.resume=none)"
            )
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown or "step" not in data:
            what = f"unknown keys {unknown}" if unknown else "no 'step'"
            raise UserError(f"{source} is not an rlcli run state ({what}; known: {sorted(known)})")
        return cls(**data)


def write_text_atomically(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old or the new content, never a part."""
    path = Path(path)
    temporary = path.with_name(f"{TEMPORARY_PREFIX}{path.name}.{os.getpid()}")
    with open(temporary, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def distributed_rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


def rng_state_file(rank: int) -> str:
    return f"rng_state_rank{rank}.safetensors"


def save_run_state(
    directory: str | os.PathLike[str], state: RunState, rank: int | None = None
) -> None:
    """Writes ``state`` (``trainer_state.json``) on rank 0, and this rank's RNG states (python,
    numpy, torch CPU and CUDA) on every rank."""
    directory = Path(directory)
    rank = distributed_rank() if rank is None else rank
    if rank == 0:
        write_text_atomically(directory / TRAINER_STATE_FILE, json.dumps(state.to_dict(), indent=2))
    tensors, metadata = _capture_rng_states()
    save_file(tensors, str(directory / rng_state_file(rank)), metadata=metadata)


def load_run_state(
    directory: str | os.PathLike[str], rank: int | None = None, restore_rng: bool = True
) -> RunState:
    """Returns the state saved by :func:`save_run_state` and restores this rank's RNGs."""
    directory = Path(directory)
    rank = distributed_rank() if rank is None else rank
    state_path = directory / TRAINER_STATE_FILE
    if not state_path.is_file():
        raise UserError(f"{state_path} is missing: {directory} is not an rlcli checkpoint.")
    state = RunState.from_dict(json.loads(state_path.read_text(encoding="utf-8")), state_path)
    if restore_rng:
        rng_path = directory / rng_state_file(rank)
        if rng_path.is_file():
            _restore_rng_states(rng_path)
        else:
            warnings.warn(
                f"{rng_path} is missing (the checkpoint was saved with fewer ranks); "
                f"rank {rank} keeps its current random state.",
                RuntimeWarning,
                stacklevel=2,
            )
    return state


# megatron's named RNG streams (parallel.mesh.rng_tracker_states) in the RNG file
TRACKER_PREFIX = "megatron_tracker/"


def _capture_rng_states() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    python_version, python_words, python_gauss = random.getstate()
    numpy_kind, numpy_keys, numpy_pos, numpy_has_gauss, numpy_gauss = np.random.get_state()
    tensors = {
        "python": torch.tensor(python_words, dtype=torch.int64),
        "numpy": torch.from_numpy(numpy_keys.astype(np.int64)),
        "torch_cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        for index, cuda_state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{index}"] = cuda_state
    tensors.update({TRACKER_PREFIX + name: state for name, state in _tracker_states().items()})
    metadata = {
        "python": json.dumps({"version": python_version, "gauss_next": python_gauss}),
        "numpy": json.dumps(
            {
                "kind": numpy_kind,
                "pos": numpy_pos,
                "has_gauss": numpy_has_gauss,
                "cached_gaussian": numpy_gauss,
            }
        ),
    }
    return tensors, metadata


def _restore_rng_states(path: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata()
    tensors = load_file(str(path))
    python = json.loads(metadata["python"])
    words = tuple(int(word) for word in tensors["python"].tolist())
    random.setstate((python["version"], words, python["gauss_next"]))
    numpy = json.loads(metadata["numpy"])
    np.random.set_state(
        (
            numpy["kind"],
            tensors["numpy"].numpy().astype(np.uint32),
            numpy["pos"],
            numpy["has_gauss"],
            numpy["cached_gaussian"],
        )
    )
    torch.set_rng_state(tensors["torch_cpu"])
    cuda_states = [
        tensors[key] for key in sorted(tensors, key=_cuda_index) if _cuda_index(key) >= 0
    ]
    if cuda_states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda_states)
    tracker = {
        k.removeprefix(TRACKER_PREFIX): v
        for k, v in tensors.items()
        if k.startswith(TRACKER_PREFIX)
    }
    if tracker:
        from parallel.mesh import set_rng_tracker_states

        set_rng_tracker_states(tracker)


def _tracker_states() -> dict[str, torch.Tensor]:
    """megatron's named RNG streams (none before a model-parallel run set them up)."""
    from parallel.mesh import rng_tracker_states

    return rng_tracker_states()


def _cuda_index(key: str) -> int:
    """The device index of a ``torch_cuda_<index>`` key, -1 for other keys."""
    return int(key.rsplit("_", 1)[1]) if key.startswith("torch_cuda_") else -1
