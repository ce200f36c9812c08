"""Save and resume for every training loop (``rlcli train``, ``rlcli rm``, ``rlcli sft``): one
helper, ``RunCheckpoints``, and the atomic replacement of a finished model folder,
``replacing_folder`` (the directory rules, the manifest check and the choice of checkpoint are
``rlcli.run.checkpoints``; the loop's own state is ``rlcli.run.state.RunState``).

    checkpoints = RunCheckpoints(manager, [CheckpointedModel("model", actor, hf_dir=model_dir)])
    resumed = checkpoints.resume(cfg.trainer.resume)   # collective; None: a fresh start
    ...
    checkpoints.save(step, RunState(step=step, ...))   # collective

A checkpoint holds each model's folder (megatron dist_checkpointing: model, optimizer, scheduler)
and, for a model given an HF folder, ``hf/`` beside it (config and tokenizer, so it converts to
HF on its own), then the run state and every rank's RNG states. An RL run's is ``model/`` and
``hf/`` for the actor; a LoRA actor's ``model/`` holds only its adapters and their optimizer
state (the base is the run's HF model, ``rlcli.model.lora``); a PPO run adds ``critic/model/`` and
``critic/hf/`` (``rlcli export --critic`` turns the two into an HF model). A reward-model run's
(``<output_dir>/rm_checkpoints``) and the SFT warm start's (``sft.save_freq``,
``<output_dir>/sft_checkpoints``) are ``model/`` alone.

Resuming takes what ``trainer.resume`` names, the newest intact checkpoint for ``auto`` and after
a torchrun restart: a damaged newest checkpoint is skipped, saying so, for the previous intact one.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist

from rlcli.errors import UserError
from rlcli.run.checkpoints import CheckpointManager
from rlcli.run.state import RunState, load_run_state, save_run_state

if TYPE_CHECKING:  # the model pulls in megatron
    from rlcli.model.trained_model import TrainedModel


@dataclass(frozen=True)
class CheckpointedModel:
    """One trained model of a run's checkpoints: its folder in them (``model``,
    ``critic/model``), what it is (in messages), the HF folder whose config and tokenizer go
    beside it as ``hf/`` (None: none), and why a checkpoint may lack it."""

    folder: str
    model: TrainedModel
    hf_dir: str | None = None
    role: str = "the model"
    absent_because: str = ""


@dataclass(frozen=True)
class Resumed:
    path: Path  # the checkpoint loaded
    state: RunState


class RunCheckpoints:
    """A training loop's checkpoints: ``save`` commits a step (every model, its optimizer and
    scheduler, the run state, the RNGs), ``resume`` loads the one ``trainer.resume`` names.
    Both are collectives: every rank calls them together.

    Args:
        manager: the checkpoint root's manager (keep_last, the manifest, the choice to resume).
        models: what the checkpoints hold, in order; the first is the one LoRA adapters belong to
            (``RunState.lora`` records them; a resume must continue the same kind of model).
        save_optimizer: false writes model-only checkpoints (smaller); a resume of one then
            reloads the optimizer's master weights from the loaded model.
        fix: what to change when the weights are not finite (the loop's config keys).
    """

    def __init__(
        self,
        manager: CheckpointManager,
        models: Sequence[CheckpointedModel],
        save_optimizer: bool = True,
        fix: str = "Lower the learning rate, keep gradient clipping on, or use model.dtype="
        "float32 / bfloat16 instead of float16.",
    ) -> None:
        self.manager = manager
        self.models = list(models)
        self.save_optimizer = save_optimizer
        self.fix = fix

    def save(self, step: int, state: RunState) -> None:
        """Commit ``step``'s checkpoint. Every kind of state of every model must be on the device
        (the trainer's ``checkpoint`` residency)."""
        from parallel.checkpoint import save_checkpoint
        from parallel.optim import all_weights_finite
        from rlcli.model.lora import lora_state

        # Collective. A non-finite weight must never reach a checkpoint (pruning would then
        # delete the good ones it replaces).
        if not all_weights_finite([m for saved in self.models for m in saved.model.models]):
            roles = " or ".join(saved.role for saved in self.models)
            raise UserError(
                f"step {step}: the weights of {roles} are not finite; not saving a checkpoint "
                f"(the newest good one is {self.manager.latest_dir() or 'none'}). {self.fix}"
            )
        state = replace(state, step=step, lora=lora_state(self.models[0].model.lora))
        with self.manager.saving(step, subdirs=[saved.folder for saved in self.models]) as out:
            for saved in self.models:
                model = saved.model
                save_checkpoint(
                    out / saved.folder,
                    model.models,
                    model.mesh,
                    optimizer=model.optimizer if self.save_optimizer else None,
                    scheduler=model.scheduler,
                    adapters_only=model.lora is not None,
                )
                if saved.hf_dir is not None and model.mesh.rank == 0:
                    copy_hf_metadata(saved.hf_dir, (out / saved.folder).parent / "hf")
            save_run_state(out, state)

    def resume(self, resume: str | None) -> Resumed | None:
        """Load the checkpoint ``trainer.resume`` names (the newest intact one for ``auto`` and
        after a torchrun restart) into the models and restore this rank's RNGs; None when the run
        starts fresh. A damaged checkpoint named explicitly is a :class:`UserError`."""
        from parallel.checkpoint import load_checkpoint
        from rlcli.model.lora import check_resumed_lora, lora_state

        # Collective: every rank checks its share of the files against the manifest.
        restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
        path = self.manager.resolve_resume(resume, restarted=restarted)
        if path is None:
            return None
        for saved in self.models:
            if not (path / saved.folder / "metadata.json").is_file():
                raise UserError(
                    f"trainer.resume: {path} has no {saved.folder} to resume {saved.role} from"
                    + (f"; {saved.absent_because}" if saved.absent_because else "")
                )
        state = load_run_state(path)
        check_resumed_lora(path, state.lora, lora_state(self.models[0].model.lora))
        for saved in self.models:
            model, folder = saved.model, path / saved.folder
            changed = load_checkpoint(
                folder,
                model.models,
                model.mesh,
                optimizer=model.optimizer if self.save_optimizer else None,
                scheduler=model.scheduler,
                adapters_only=model.lora is not None,
            )
            if changed and model.mesh.rank == 0:
                # The current config wins over the checkpoint's hyper-parameters; say what changed.
                print(f"[rlcli] resuming {folder} with the config's values: " + "; ".join(changed))
            if not self.save_optimizer and model.optimizer is not None:
                from parallel.optim import reload_master_weights

                # bf16 / distributed optimizers keep fp32 master weights; without this the first
                # step writes the pre-resume weights back over the loaded ones.
                reload_master_weights(model.optimizer)
        return Resumed(path, state)


@contextmanager
def replacing_folder(out: Path, rank: int) -> Iterator[Path]:
    """Collective: a fresh staging folder (``<out>.tmp``) for every rank to write a finished
    model into; on exit rank 0 puts it in place of ``out`` whole, so a crash mid-save leaves only
    the ``.tmp`` folder, never a partial ``out``. On an exception nothing is replaced."""
    staging = out.with_name(out.name + ".tmp")
    if rank == 0 and staging.exists():
        shutil.rmtree(staging)
    _barrier()
    yield staging
    _barrier()  # every rank wrote its share
    if rank == 0:
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    _barrier()


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def copy_hf_metadata(model_dir: str, out: Path) -> None:
    from parallel.convert.hf_io import copy_tokenizer_files

    copy_tokenizer_files(model_dir, out)
    for name in ("config.json", "generation_config.json"):
        if (Path(model_dir) / name).is_file():
            shutil.copy2(Path(model_dir) / name, out / name)
