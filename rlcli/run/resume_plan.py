"""What ``rlcli train`` does with a folder that already holds a run, said before any work starts.

A run saves its resolved settings in every checkpoint's run state (``RunState.settings``: the
config as dotted keys). Started again on the same folder (``trainer.resume=auto``, the default),
rlcli compares them with the current config first:

- settings a resumed run cannot take (another start model, estimator, SFT warm start, training
  data) are refused with exit 2, naming each key and both values (a checkpoint named by
  ``trainer.resume=PATH`` is asked for: there they are listed, not refused);
- the run is already at ``trainer.total_steps``: "nothing to do", exit 0;
- otherwise it resumes and lists the settings that differ (the current config wins).

This runs in the launching process before torchrun and before any model is built, so a run that
would do nothing, or the wrong thing, costs a second, not a model build.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlcli.config.schema import RLConfig, to_dict
from rlcli.errors import UserError
from rlcli.run.checkpoints import CheckpointManager, checkpoint_root, is_complete_checkpoint
from rlcli.run.state import TRAINER_STATE_FILE, RunState

# Settings that decide what a checkpoint is: a resume with other values would continue a
# different run (another start model or warm start, a critic that is not there, a loader
# position in other data). A key refuses when it or a key under it differs.
FIXED_FOR_A_RUN = (
    "model.path",
    "model.build",
    "model.spec",
    "sft",
    "algorithm.adv_estimator",
    "actor.lora",
    "data.train_files",
)
# What decides the SFT warm start's model (``<output_dir>/sft_model``): it is reused only when these
# are as recorded beside it (the actor's optimizer keys besides lr and warmup, which sft.* sets).
DECIDES_THE_WARM_START = (
    "model",
    "sft",
    "trainer.seed",
    "data.synthetic",
    "data.synthetic_tool_share",
    "actor.min_lr",
    "actor.weight_decay",
    "actor.adam_beta1",
    "actor.adam_beta2",
    "actor.adam_eps",
    "actor.grad_clip",
    "actor.lr_decay_style",
)
WARM_START_SETTINGS_FILE = "rlcli_sft_settings.json"
# Keys that never matter to a resume.
NOT_COMPARED = ("trainer.resume",)


def run_settings(cfg: RLConfig) -> dict[str, Any]:
    """The resolved config as ``{"section.key": value}`` (JSON values), what a checkpoint keeps."""
    nested = to_dict(cfg)
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for key, inner in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), inner)
        else:
            flat[prefix] = value

    walk("", nested)
    return json.loads(json.dumps(flat))


def _under(key: str, prefixes: tuple[str, ...]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def changed_settings(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{key: (saved value, current value)}`` for every compared key whose value differs (a key
    one side lacks counts as changed, its value ``None`` there)."""
    return {
        key: (saved.get(key), current.get(key))
        for key in sorted(set(saved) | set(current))
        if not _under(key, NOT_COMPARED) and saved.get(key) != current.get(key)
    }


def _describe(changes: dict[str, tuple[Any, Any]]) -> str:
    return "; ".join(f"{key} {old!r} -> {new!r}" for key, (old, new) in changes.items())


@dataclass(frozen=True)
class ResumePlan:
    checkpoint: Path
    step: int
    message: str  # what the run will do, for the console
    nothing_to_do: bool


def _loadable(path: Path) -> bool:
    """The manifest's sizes hold (the resume itself also checks the checksums)."""
    from rlcli.run.manifest import check_checkpoint

    return check_checkpoint(path, checksums=False).loadable


def _checkpoint_to_resume(cfg: RLConfig) -> tuple[Path | None, bool]:
    """The checkpoint a resume will load (by its sizes: the newest intact one for ``auto``), and
    whether ``trainer.resume`` named it explicitly."""
    resume = cfg.trainer.resume
    if resume is None or str(resume).lower() in ("none", "null", ""):
        return None, False
    if str(resume).lower() != "auto":
        path = Path(resume)
        # a damaged or missing one: the resume itself says why
        return (path if is_complete_checkpoint(path) and _loadable(path) else None), True
    root = checkpoint_root(cfg.checkpoint.dir, cfg.trainer.output_dir)
    for path in CheckpointManager(root, rank=0, world_size=1).complete_dirs():
        if _loadable(path):
            return path, False
    return None, False


def plan_resume(cfg: RLConfig) -> ResumePlan | None:
    """What starting ``cfg`` does to the run its folder holds: None for a fresh start (or a
    torchrun restart, which keeps its config); a :class:`UserError` for settings a resume cannot
    change."""
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return None
    path, named = _checkpoint_to_resume(cfg)
    if path is None:
        return None
    try:
        data = json.loads((path / TRAINER_STATE_FILE).read_text(encoding="utf-8"))
        state = RunState.from_dict(data, path / TRAINER_STATE_FILE)
    except (OSError, ValueError, UserError):
        return None  # damaged or foreign: the resume itself reports it, or takes an older one
    total = cfg.trainer.total_steps
    if state.settings is None:
        changes: dict[str, tuple[Any, Any]] = {}
        note = " (its checkpoint records no settings to compare: written by an older rlcli)"
    else:
        changes = changed_settings(state.settings, run_settings(cfg))
        note = ""
    # A checkpoint named by trainer.resume is asked for (fine-tuning on from another run's step,
    # in a folder of its own): what differs is listed, not refused.
    fixed = {key: change for key, change in changes.items() if _under(key, FIXED_FOR_A_RUN)}
    if fixed and not named:
        raise UserError(
            f"{path} holds a run at step {state.step} with settings a resume cannot change: "
            f"{_describe(fixed)}. To train with the new settings start a new run "
            "(trainer.output_dir=<another folder>), or start over in this folder with "
            "trainer.resume=none; to continue this run, keep its values"
        )
    if total and state.step >= total:
        message = (
            f"nothing to do: {path} is at step {state.step} and trainer.total_steps={total}. "
            f"Raise trainer.total_steps to train further from step {state.step}, or start a new "
            "run with trainer.output_dir=<another folder>"
        )
        return ResumePlan(path, state.step, message, nothing_to_do=True)
    message = f"resuming from step {state.step} ({path}){note}"
    others = {key: change for key, change in changes.items() if key != "trainer.total_steps"}
    if others:
        message += f"; with the current config's values: {_describe(others)}"
    return ResumePlan(path, state.step, message, nothing_to_do=False)


def warm_start_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """The part of a run's settings that decides its SFT warm start."""
    return {key: value for key, value in settings.items() if _under(key, DECIDES_THE_WARM_START)}


def warm_start_changes(model_dir: Path, settings: dict[str, Any]) -> str | None:
    """Why the warm start in ``model_dir`` cannot be reused with ``settings`` (None: it can)."""
    record = model_dir / WARM_START_SETTINGS_FILE
    if not record.is_file():
        return f"{record.name} is missing (written by an older rlcli): its settings are unknown"
    saved = json.loads(record.read_text(encoding="utf-8"))
    changes = changed_settings(saved, warm_start_settings(settings))
    return _describe(changes) if changes else None


def record_warm_start(model_dir: Path, settings: dict[str, Any]) -> None:
    (model_dir / WARM_START_SETTINGS_FILE).write_text(
        json.dumps(warm_start_settings(settings), indent=1, sort_keys=True), encoding="utf-8"
    )
