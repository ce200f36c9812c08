"""The actor's LoRA settings across a run: the adapters ``actor.lora`` asks for, what a checkpoint
records of them (the run state's ``lora``: a LoRA checkpoint holds only the adapters, so
resume and export rebuild the base from the run's HF model and need the adapters' shape), and the
check that a resumed run continues the same kind of actor.

    lora_spec(cfg.actor.lora, seed) -> LoraSpec | None     None: full fine-tuning
    lora_state(spec) -> dict | None;  spec_of_state(run_state) -> LoraSpec | None
    check_resumed_lora(checkpoint, saved, wanted)           UserError naming the key to set
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from parallel.lora import LoraSpec
from rlcli.errors import UserError

if TYPE_CHECKING:
    from rlcli.config.schema import LoraConfig
    from rlcli.run.state import RunState


def lora_spec(lora: LoraConfig, seed: int) -> LoraSpec | None:
    """The adapters ``actor.lora`` asks for (None: full fine-tuning); ``seed`` draws A."""
    if not lora.enable:
        return None
    return LoraSpec(
        rank=lora.rank,
        alpha=lora.alpha,
        dropout=lora.dropout,
        target_modules=tuple(lora.target_modules),
        seed=seed,
    )


def lora_state(spec: LoraSpec | None) -> dict[str, Any] | None:
    """What a checkpoint records of the actor's LoRA adapters (None: full fine-tuning)."""
    if spec is None:
        return None
    return {
        "rank": spec.rank,
        "alpha": spec.alpha,
        "dropout": spec.dropout,
        "target_modules": list(spec.targets()),
        "seed": spec.seed,
    }


def check_resumed_lora(path: Path, saved: dict | None, wanted: dict | None) -> None:
    """A run resumes only the kind of actor it saved (``saved``: the checkpoint's ``lora_state``,
    ``wanted``: the config's): full weights, or adapters of the same shape."""
    where = f"trainer.resume: {path}"
    if saved is None and wanted is not None:
        raise UserError(
            f"{where} holds a fully fine-tuned actor, not LoRA adapters: resume it with "
            "actor.lora.enable=false, or start the LoRA run in a new trainer.output_dir"
        )
    if saved is not None and wanted is None:
        raise UserError(
            f"{where} holds LoRA adapters (rank {saved['rank']}): resume it with "
            f"actor.lora.enable=true and its settings, or use trainer.resume=none"
        )
    if saved is None or wanted is None:
        return
    for key in ("rank", "alpha", "target_modules"):
        if saved[key] != wanted[key]:
            shown = saved[key] if key != "target_modules" else f"[{','.join(saved[key])}]"
            raise UserError(
                f"{where} has LoRA adapters with {key}={saved[key]}, the config asks for "
                f"{wanted[key]}: set actor.lora.{key}={shown} to continue it"
            )


def spec_of_state(state: RunState) -> LoraSpec | None:
    """The adapters a checkpoint's run state records (None: a fully fine-tuned actor)."""
    saved = state.lora
    if saved is None:
        return None
    return LoraSpec(
        rank=int(saved["rank"]),
        alpha=float(saved["alpha"]),
        dropout=float(saved["dropout"]),
        target_modules=tuple(saved["target_modules"]),
        seed=int(saved["seed"]),
    )
