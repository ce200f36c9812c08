"""What a run puts into its checkpoint and takes back out: ``save_run`` and ``resume_run`` (the
directory rules, the manifest check and the choice of checkpoint are ``rlcli.run_checkpoint``).

A run's checkpoint holds ``model/`` (megatron dist_checkpointing: model, optimizer, scheduler),
``hf/`` (config and tokenizer, so it converts to HF on its own) and the trainer state (step, data
position, KL coefficient, RNG states). A LoRA actor's ``model/`` holds only its adapters and
their optimizer state; the base is the run's HF model (``rlcli.lora``). A PPO run adds
``critic/model/`` (the value model, its optimizer and scheduler, same format) and ``critic/hf/``
(the config and tokenizer the critic was built from; ``rlcli export --critic`` turns the two into
an HF model).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlcli.errors import UserError
from rlcli.run_checkpoint import CheckpointManager
from rlcli.run_state import load_trainer_state, save_trainer_state

if TYPE_CHECKING:  # the model pulls in megatron
    from rlcli.trained_model import TrainedModel


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
            f"step {step}: the actor's or critic's weights are not finite; not saving a "
            f"checkpoint (the newest good one is {ckpt.latest_dir() or 'none'}). Lower actor.lr, "
            "keep actor.grad_clip > 0, or use model.dtype=float32 / bfloat16 instead of float16."
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
    """Load the checkpoint ``trainer.resume`` names (the newest intact one for ``auto`` and after
    a torchrun restart) into ``actor`` (and ``critic``); its trainer state, or None when the run
    starts fresh. A damaged checkpoint named explicitly is a :class:`UserError`."""
    from parallel.checkpoint import load_checkpoint
    from rlcli.lora import check_resumed_lora, lora_state

    # Collective: every rank checks its share of the files against the manifest.
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    path = ckpt.resolve_resume(resume, restarted=restarted)
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
