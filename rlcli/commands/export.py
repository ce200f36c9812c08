"""``rlcli export``: a training checkpoint as an HF model folder (the policy, PPO's critic, or a
LoRA run's adapters, alone or merged into the base).

    rlcli export CHECKPOINT --out HF_DIR          (mcore-to-hf at TP1)
    rlcli export CHECKPOINT --out HF_DIR --critic (PPO's value model, see ``export_critic``)
    rlcli export CHECKPOINT --out DIR --lora      (a LoRA run's adapters as a PEFT folder)
    rlcli export CHECKPOINT --out HF_DIR --merge  (a LoRA run's base with the adapters merged)
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Optional

import typer

from rlcli.commands.convert import mcore_to_hf
from rlcli.errors import UserError


def export(
    checkpoint: Path = typer.Argument(
        ...,
        help="A checkpoint folder (outputs/run/checkpoints/step_000100), or a run's checkpoint "
        "or output folder (its newest checkpoint).",
    ),
    out: Path = typer.Option(
        ..., "--out", help="Output HF model folder (safetensors + config + tokenizer)."
    ),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Replace what --out holds (otherwise a non-empty --out stops)."
    ),
    critic: bool = typer.Option(
        False, "--critic", help="Export PPO's critic (value model) instead of the policy."
    ),
    lora: bool = typer.Option(
        False, "--lora", help="A LoRA run's adapters as a PEFT adapter folder (peft loads it)."
    ),
    merge: bool = typer.Option(
        False, "--merge", help="A LoRA run's policy as a full HF model, the adapters merged."
    ),
    base_model: Optional[Path] = typer.Option(
        None,
        "--base-model",
        help="LoRA: the HF model the run trained from (default: the one trainer_state.json names).",
    ),
) -> None:
    """Write a training checkpoint's policy (or, with --critic, its value model) as a
    HuggingFace model directory; a LoRA run's policy as a PEFT adapter (--lora) or merged into
    its base model (--merge)."""
    from rlcli.model.lora import spec_of_state
    from rlcli.run.checkpoints import is_complete_checkpoint
    from rlcli.run.manifest import check_checkpoint
    from rlcli.run.state import load_run_state

    checkpoint = _newest_checkpoint_of(checkpoint)
    if not is_complete_checkpoint(checkpoint):
        raise UserError(f"{checkpoint} is not a complete rlcli checkpoint (no COMPLETE marker)")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise UserError(
            f"--out {out} is not empty: give a new folder, or --overwrite to replace what it holds"
        )
    if overwrite and out.is_dir():
        shutil.rmtree(out)  # no stale shard of an earlier export stays beside the new ones
    health = check_checkpoint(checkpoint)
    if not health.loadable:
        raise UserError(
            f"{checkpoint}: the checkpoint is damaged: {health.describe()}. Export an intact one "
            f"(`rlcli checkpoint verify {checkpoint.parent}` lists them) or restore the file."
        )
    if health.state == "unverifiable":
        typer.echo(f"note: {checkpoint} has {health.describe()}")
    if lora and merge:
        raise UserError("--lora and --merge: choose one (adapters only, or merged into the base)")
    if critic and (lora or merge):
        raise UserError("--critic: the critic has no LoRA adapters; drop --lora / --merge")
    if critic:  # the critic's own folder says all it needs
        export_critic(checkpoint, out)
        readable_by_all(out)
        return
    state = load_run_state(checkpoint, rank=0, restore_rng=False)
    spec = spec_of_state(state)
    if (lora or merge) and spec is None:
        raise UserError(
            f"{checkpoint} holds a fully fine-tuned policy, not LoRA adapters: export it "
            "without --lora / --merge"
        )
    if spec is not None:
        if not (lora or merge):
            raise UserError(
                f"{checkpoint} holds only the LoRA adapters (actor.lora; the base is "
                f"{state.model_dir}): export them with --lora (a PEFT adapter folder) or "
                "--merge (a full HF model, the adapters merged into the base)"
            )
        base = Path(base_model or state.model_dir)
        # absolute, so the adapter's base_model_name_or_path holds from any folder
        export_lora(checkpoint, out, spec, base.resolve() if base.exists() else base, merge=merge)
    else:
        mcore_to_hf(ckpt=checkpoint, out=out, tp=1, pp=1, hf_config_dir=None)
    readable_by_all(out)


def _newest_checkpoint_of(path: Path) -> Path:
    """``path`` itself when it is a step_N checkpoint; for a run's checkpoint folder (or its
    output folder) the newest complete checkpoint in it, said on the console."""
    from rlcli.run.checkpoints import CheckpointManager, is_complete_checkpoint

    if is_complete_checkpoint(path) or not path.is_dir():
        return path
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    newest = CheckpointManager(root, rank=0, world_size=1).latest_dir()
    if newest is None:
        return path  # the caller names what is missing
    typer.echo(f"exporting the newest checkpoint of {root}: {newest.name}")
    return newest


def readable_by_all(out: Path) -> None:
    """The exported files with the modes a plain file gets here (the umask's), not the 0600
    that atomic writes through temporary files leave."""
    umask = os.umask(0)
    os.umask(umask)
    for path in out.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def export_lora(checkpoint: Path, out: Path, spec, base: Path, *, merge: bool) -> None:
    """A LoRA run's checkpoint (its adapters; the base is the HF model ``base``): the adapters as
    a PEFT folder (``adapter_config.json`` through peft's LoraConfig, ``base_model_name_or_path``
    the base; ``peft.PeftModel.from_pretrained(base_model, out)`` loads it), or with ``merge``
    the base with W + (alpha/r) B A in every adapted tensor, as a plain HF model."""
    from transformers import AutoConfig

    from parallel.checkpoint import load_checkpoint
    from parallel.convert import hf_model_dir_problem
    from parallel.hf_model import load_hf_model
    from parallel.lora import apply_lora
    from parallel.lora_io import save_merged_hf_checkpoint, save_peft_adapter
    from parallel.mesh import destroy_parallel, init_parallel
    from parallel.model import build_model

    problem = hf_model_dir_problem(base) if merge else None
    if problem is not None:
        raise UserError(
            f"--merge needs the base model the run trained from, {base} ({checkpoint}/"
            f"trainer_state.json's model_dir, or --base-model DIR): {problem}"
        )
    mesh = init_parallel(tp=1, pp=1)
    hf_config = AutoConfig.from_pretrained(checkpoint / "hf")
    # The adapters alone need no base weights: only --merge reads them.
    models = load_hf_model(base, mesh) if merge else build_model(hf_config, mesh)
    apply_lora(models, spec)
    load_checkpoint(checkpoint / "model", models, mesh, adapters_only=True)
    if merge:
        save_merged_hf_checkpoint(models, mesh, out, hf_config, tokenizer_dir=checkpoint / "hf")
    else:
        save_peft_adapter(models, mesh, out, base_model_name_or_path=str(base))
    if mesh.rank == 0:
        kind = "HF model (LoRA merged)" if merge else "PEFT adapter"
        typer.echo(f"wrote {kind} {out} (base {base})")
    destroy_parallel()


def export_critic(checkpoint: Path, out: Path) -> None:
    """PPO's critic (``CHECKPOINT/critic``) as an HF token-classification model with one label:
    ``config.json`` names e.g. ``Qwen2ForTokenClassification`` with ``num_labels: 1``; the
    weights are the transformer's (``model.*``) plus the value head ``score.weight [1, h]`` and
    ``score.bias [1]``. ``AutoModelForTokenClassification.from_pretrained(out)(ids).logits[...,
    0]`` is the value at every position (the trainer reads it at the position that predicts each
    response token)."""
    folder = checkpoint / "critic"
    if not (folder / "model" / "metadata.json").is_file():
        raise UserError(
            f"{checkpoint} has no critic (critic/model): only PPO runs "
            "(algorithm.adv_estimator=gae) save one"
        )
    from transformers import AutoConfig

    from parallel.checkpoint import load_checkpoint
    from parallel.convert import save_hf_checkpoint
    from parallel.mesh import destroy_parallel, init_parallel
    from parallel.model import build_model
    from rlcli.train.critic import value_model_config

    mesh = init_parallel(tp=1, pp=1)
    hf_config = AutoConfig.from_pretrained(folder / "hf")
    models = build_model(hf_config, mesh, critic=True)
    load_checkpoint(folder / "model", models, mesh)
    save_hf_checkpoint(
        models, mesh, out, value_model_config(hf_config), tokenizer_dir=folder / "hf"
    )
    if mesh.rank == 0:
        typer.echo(f"wrote HF value model {out}")
    destroy_parallel()
