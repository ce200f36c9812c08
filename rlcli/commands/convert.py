"""``rlcli convert``: HF <-> Megatron (megatron-core dist_checkpointing) and a
parity check. The Megatron work lives in ``parallel/`` (``parallel.hf_model``,
``parallel.parity``, ``parallel.checkpoint``, ``parallel.convert``); these commands check their
inputs, start torchrun when needed and print.

    rlcli convert hf-to-mcore --model HF_DIR --out DIR --tp T --pp P
    rlcli convert mcore-to-hf --ckpt DIR --out HF_DIR [--tp T --pp P] [--hf-config DIR]
    rlcli convert verify      --model HF_DIR --tp T --pp P [--ep E --expert-tp T2] [--tolerance X]
    rlcli convert language-model --model MULTIMODAL_DIR --out HF_DIR   (Qwen3.5's text model)

``rlcli export`` (a training checkpoint as an HF folder) is ``rlcli.commands.export``.

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
        (models[0].multimodal_config or models[0].hf_config).save_pretrained(out / "hf")
        copy_tokenizer_files(model, out / "hf")
        typer.echo(f"wrote Megatron checkpoint {out} (saved at tp={tp} pp={pp})")
    destroy_parallel()


@convert_app.command("language-model")
def language_model(
    model: Path = typer.Option(
        ..., "--model", help="Multimodal HF checkpoint folder (e.g. Qwen3.5's, model_type qwen3_5)."
    ),
    out: Path = typer.Option(..., "--out", help="New folder for its language model alone."),
) -> None:
    """Take the language model out of a multimodal checkpoint (Qwen3.5 is released as one) into
    a text model folder rlcli trains; the vision tower is left behind
    (``parallel.convert.language_model``)."""
    import json

    from parallel.convert.language_model import extract_language_model
    from parallel.convert.registry import language_model_type

    config_file = model / "config.json"
    if not config_file.is_file():
        raise UserError(f"--model {model}: no config.json there")
    config = json.loads(config_file.read_text())
    if language_model_type(config) is None:
        raise UserError(
            f"--model {model}: model_type {config.get('model_type')!r} is not a multimodal "
            "checkpoint around a language model rlcli has a family for (a text model folder "
            "needs no extraction)"
        )
    if out.exists() and any(out.iterdir()):
        raise UserError(f"--out {out} exists and is not empty; choose a new folder")
    extracted = extract_language_model(model, out)
    typer.echo(f"wrote {out}: {extracted.describe()}")


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
