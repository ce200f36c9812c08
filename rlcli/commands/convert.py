"""``rlcli convert`` and ``rlcli export``: HF <-> Megatron (megatron-core dist_checkpointing) and a
parity check. The Megatron work lives in ``parallel/`` (``parallel.hf_model``,
``parallel.parity``, ``parallel.checkpoint``, ``parallel.convert``); these commands check their
inputs, start torchrun when needed and print.

    rlcli convert hf-to-mcore --model HF_DIR --out DIR --tp T --pp P
    rlcli convert mcore-to-hf --ckpt DIR --out HF_DIR [--tp T --pp P] [--hf-config DIR]
    rlcli convert verify      --model HF_DIR --tp T --pp P [--ep E --expert-tp T2] [--tolerance X]
    rlcli export CHECKPOINT --out HF_DIR          (a training checkpoint; mcore-to-hf at TP1)
    rlcli export CHECKPOINT --out HF_DIR --critic (PPO's value model, see ``export_critic``)
    rlcli export CHECKPOINT --out DIR --lora      (a LoRA run's adapters as a PEFT folder)
    rlcli export CHECKPOINT --out HF_DIR --merge  (a LoRA run's base with the adapters merged)

Multi-process: when tp * pp > 1 and the command is not already running under torchrun, it
runs itself again under torchrun with tp * pp processes on this machine
(``rlcli.commands.relaunch``); ``verify --ep E`` (MoE models) with pp * lcm(tp, E * expert TP)
processes, i.e. tp * pp * E with the default expert TP (= tp). To use more machines, start ``-m rlcli.cli convert ...`` under
torchrun yourself.

The mcore checkpoint written by hf-to-mcore is a folder with
    model/   megatron-core dist_checkpointing (``parallel.checkpoint``; reshardable, so it loads
             at any --tp / --pp in mcore-to-hf)
    hf/      config.json and tokenizer files of the source model (needed to rebuild the model)
For a checkpoint written elsewhere, pass its model folder as --ckpt and the HF config folder as
--hf-config.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Optional

import typer

from rlcli.commands.relaunch import relaunch_under_torchrun, under_torchrun
from rlcli.errors import UserError

convert_app = typer.Typer(
    help="Convert between HF safetensors and Megatron checkpoints; verify Megatron vs HF parity.",
    no_args_is_help=True,
)

TP = typer.Option(1, "--tp", help="Tensor-parallel size (processes = tp * pp).")
PP = typer.Option(1, "--pp", help="Pipeline-parallel size (processes = tp * pp).")


def _relaunch_if_parallel(tp: int, pp: int, convert_args: list[str], processes: int = 0) -> None:
    """When the layout needs more than one process outside torchrun: run ``rlcli convert
    CONVERT_ARGS`` under torchrun with `processes` (default tp*pp) processes and exit with its
    outcome. Otherwise return and run here."""
    if tp < 1 or pp < 1:
        raise UserError(f"--tp and --pp must be >= 1 (got --tp {tp} --pp {pp})")
    processes = processes or tp * pp
    if processes > 1 and not under_torchrun():
        relaunch_under_torchrun(processes, ["convert", *convert_args])


def _checked_hf_dir(path: Path, option: str) -> Path:
    from parallel.convert import hf_model_dir_problem

    problem = hf_model_dir_problem(path)
    if problem is not None:
        raise UserError(f"{option} {path}: {problem}")
    return path


@convert_app.command("hf-to-mcore")
def hf_to_mcore(
    model: Path = typer.Option(..., "--model", help="HF model folder (config.json, safetensors)."),
    out: Path = typer.Option(..., "--out", help="Output folder for the Megatron checkpoint."),
    tp: int = TP,
    pp: int = PP,
) -> None:
    """Load an HF model into Megatron at TP x PP and save it with dist_checkpointing."""
    _checked_hf_dir(model, "--model")
    args = ["hf-to-mcore", "--model", str(model), "--out", str(out), "--tp", str(tp)]
    _relaunch_if_parallel(tp, pp, [*args, "--pp", str(pp)])
    from parallel.checkpoint import save_checkpoint
    from parallel.convert.hf_io import copy_tokenizer_files
    from parallel.hf_model import load_hf_model
    from parallel.mesh import destroy_parallel, init_parallel

    mesh = init_parallel(tp=tp, pp=pp)
    models = load_hf_model(model, mesh)
    save_checkpoint(out / "model", models, mesh)
    if mesh.rank == 0:
        models[0].hf_config.save_pretrained(out / "hf")
        copy_tokenizer_files(model, out / "hf")
        typer.echo(f"wrote Megatron checkpoint {out} (saved at tp={tp} pp={pp})")
    destroy_parallel()


@convert_app.command("mcore-to-hf")
def mcore_to_hf(
    ckpt: Path = typer.Option(..., "--ckpt", help="Folder written by hf-to-mcore."),
    out: Path = typer.Option(..., "--out", help="Output HF model folder."),
    tp: int = TP,
    pp: int = PP,
    hf_config_dir: Optional[Path] = typer.Option(
        None, "--hf-config", help="Folder with the model's config.json (default: CKPT/hf)."
    ),
) -> None:
    """Load a Megatron checkpoint (at any TP x PP) and write HF safetensors + config.json."""
    model_dir = ckpt / "model" if (ckpt / "model").is_dir() else ckpt
    config_dir = hf_config_dir or ckpt / "hf"
    if not (model_dir / "metadata.json").is_file():
        raise UserError(f"--ckpt {ckpt}: no dist checkpoint (metadata.json) in {model_dir}")
    if not (config_dir / "config.json").is_file():
        raise UserError(f"no config.json in {config_dir}: pass --hf-config with the HF config")
    args = ["mcore-to-hf", "--ckpt", str(ckpt), "--out", str(out), "--tp", str(tp)]
    args += ["--pp", str(pp), "--hf-config", str(config_dir)]
    _relaunch_if_parallel(tp, pp, args)
    from transformers import AutoConfig

    from parallel.checkpoint import load_checkpoint
    from parallel.convert import save_hf_checkpoint
    from parallel.mesh import destroy_parallel, init_parallel
    from parallel.model import build_model

    mesh = init_parallel(tp=tp, pp=pp)
    hf_config = AutoConfig.from_pretrained(config_dir)
    models = build_model(hf_config, mesh)
    load_checkpoint(model_dir, models, mesh)
    save_hf_checkpoint(models, mesh, out, hf_config, tokenizer_dir=config_dir)
    if mesh.rank == 0:
        typer.echo(f"wrote HF model {out}")
    destroy_parallel()


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


def _expert_layout(model: Path, tp: int, ep: int, expert_tp: Optional[int]) -> int:
    """The expert TP size of `verify --ep`, checked against the model's config.json."""
    import json

    etp = expert_tp or tp
    if ep < 1 or etp < 1:
        raise UserError(f"--ep and --expert-tp must be >= 1 (got --ep {ep} --expert-tp {etp})")
    from parallel.model_shapes import num_experts_of

    experts = num_experts_of(json.loads((model / "config.json").read_text()))
    if (ep > 1 or expert_tp is not None) and not experts:
        raise UserError(f"--ep / --expert-tp: {model} is a dense model (no num_experts)")
    if experts and experts % ep:
        raise UserError(f"--ep {ep} must divide the model's {experts} experts (config.json)")
    return etp


@convert_app.command("verify")
def verify(
    model: Path = typer.Option(..., "--model", help="HF model folder (config.json, safetensors)."),
    tp: int = TP,
    pp: int = PP,
    ep: int = typer.Option(1, "--ep", help="Expert-parallel size (MoE models)."),
    expert_tp: Optional[int] = typer.Option(
        None, "--expert-tp", help="The experts' tensor-parallel size (MoE; default: --tp)."
    ),
    tolerance: float = typer.Option(
        1e-3, "--tolerance", help="Largest accepted |Megatron - HF| logit difference (fp32)."
    ),
) -> None:
    """Megatron (TP x PP, experts over EP) vs HF transformers logits on a fixed batch, and
    HF->Megatron->HF round-trip exactness. Exit code 1 when either check fails."""
    import math

    _checked_hf_dir(model, "--model")
    etp = _expert_layout(model, tp, ep, expert_tp)
    args = ["verify", "--model", str(model), "--tp", str(tp), "--pp", str(pp)]
    args += ["--tolerance", str(tolerance)]
    if ep > 1 or expert_tp is not None:  # (a dense model refuses the expert options)
        args += ["--ep", str(ep), "--expert-tp", str(etp)]
    _relaunch_if_parallel(tp, pp, args, processes=pp * math.lcm(tp, ep * etp))
    from parallel.mesh import ParallelLayoutError, destroy_parallel, init_parallel
    from parallel.parity import verify_conversion

    try:
        mesh = init_parallel(tp=tp, pp=pp, ep=ep, etp=etp)
    except ParallelLayoutError as err:
        raise UserError(str(err)) from None
    report = verify_conversion(model, mesh, tolerance)
    if mesh.rank == 0:
        experts = f" ep={ep} expert_tp={etp}" if ep > 1 or etp != tp else ""
        typer.echo(f"layout tp={tp} pp={pp}{experts}: batch {report.batch}x{report.length} tokens")
        typer.echo(
            f"max |megatron - hf| logit difference: {report.max_logit_diff:.3e} "
            f"(tolerance {tolerance:g})"
        )
        state = (
            "exact"
            if report.round_trip_exact
            else f"NOT exact: differ {report.mismatched}, missing {report.missing}"
        )
        typer.echo(f"HF -> Megatron -> HF round trip of {report.tensors} tensors: {state}")
    destroy_parallel()
    if not report.passed:
        raise typer.Exit(1)
