"""``rlcli convert``: HF <-> Megatron (megatron-core dist_checkpointing) and a parity check.

    rlcli convert hf-to-mcore --model HF_DIR --out DIR --tp T --pp P
    rlcli convert mcore-to-hf --ckpt DIR --out HF_DIR [--tp T --pp P] [--hf-config DIR]
    rlcli convert verify      --model HF_DIR --tp T --pp P [--tolerance X]

Multi-process: when tp * pp > 1 and the command is not already running under torchrun, it
starts itself again as ``python -m torch.distributed.run --standalone --nproc_per_node=tp*pp
-m rlcli.commands.convert <same command>`` on this machine (OMP_NUM_THREADS defaults to 1 for
the children) and exits with its exit code. To use more machines, start the module under
torchrun yourself.

The mcore checkpoint written by hf-to-mcore is a folder with
    model/   megatron-core dist_checkpointing (``parallel.checkpoint``; reshardable, so it loads
             at any --tp / --pp in mcore-to-hf)
    hf/      config.json and tokenizer files of the source model (needed to rebuild the model)
For a checkpoint written elsewhere (e.g. by training), pass its model folder as --ckpt and the
HF config folder as --hf-config.

Heavy imports (torch, megatron-core) happen inside the commands.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import typer

from rlcli.errors import UserError

convert_app = typer.Typer(
    help="Convert between HF safetensors and Megatron checkpoints; verify Megatron vs HF parity.",
    no_args_is_help=True,
)

TP = typer.Option(1, "--tp", help="Tensor-parallel size (processes = tp * pp).")
PP = typer.Option(1, "--pp", help="Pipeline-parallel size (processes = tp * pp).")
VERIFY_TOKENS = (2, 32)  # batch, sequence length of the fixed verify batch


def _relaunch_under_torchrun(tp: int, pp: int, command: list[str]) -> None:
    """When tp*pp > 1 outside torchrun: run `command` (this module's CLI arguments) under
    torchrun with tp*pp processes and exit with its code. Otherwise return and run here."""
    if tp < 1 or pp < 1:
        raise UserError(f"--tp and --pp must be >= 1 (got --tp {tp} --pp {pp})")
    if tp * pp == 1 or "LOCAL_RANK" in os.environ:
        return
    repo_root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo_root, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc_per_node={tp * pp}", "-m", "rlcli.commands.convert", *command]
    code = subprocess.run(cmd, env=env).returncode
    raise typer.Exit(code)


def _checked_hf_dir(path: Path, option: str) -> Path:
    if not (path / "config.json").is_file():
        raise UserError(f"{option} {path}: not an HF model folder (no config.json)")
    if not any(path.glob("*.safetensors")):
        raise UserError(f"{option} {path}: no *.safetensors weights (only safetensors are read)")
    return path


def _say(mesh, message: str) -> None:
    if mesh.rank == 0:
        typer.echo(message)


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
    _relaunch_under_torchrun(tp, pp, [*args, "--pp", str(pp)])
    from transformers import AutoConfig

    from parallel.checkpoint import save_checkpoint
    from parallel.convert import load_hf_weights
    from parallel.convert.hf_io import copy_tokenizer_files
    from parallel.mesh import destroy_parallel, init_parallel
    from parallel.model import build_model

    mesh = init_parallel(tp=tp, pp=pp)
    hf_config = AutoConfig.from_pretrained(model)
    models = build_model(hf_config, mesh)
    load_hf_weights(models, mesh, model)
    save_checkpoint(out / "model", models, mesh)
    if mesh.rank == 0:
        hf_config.save_pretrained(out / "hf")
        copy_tokenizer_files(model, out / "hf")
    _say(mesh, f"wrote Megatron checkpoint {out} (saved at tp={tp} pp={pp})")
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
    _relaunch_under_torchrun(tp, pp, args)
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
    _say(mesh, f"wrote HF model {out}")
    destroy_parallel()


@convert_app.command("verify")
def verify(
    model: Path = typer.Option(..., "--model", help="HF model folder (config.json, safetensors)."),
    tp: int = TP,
    pp: int = PP,
    tolerance: float = typer.Option(
        1e-3, "--tolerance", help="Largest accepted |Megatron - HF| logit difference (fp32)."
    ),
) -> None:
    """Megatron (TP x PP) vs HF transformers logits on a fixed batch, and HF->Megatron->HF
    round-trip exactness. Exit code 1 when either check fails."""
    _checked_hf_dir(model, "--model")
    args = ["verify", "--model", str(model), "--tp", str(tp), "--pp", str(pp)]
    _relaunch_under_torchrun(tp, pp, [*args, "--tolerance", str(tolerance)])
    if not _run_verify(model, tp=tp, pp=pp, tolerance=tolerance):
        raise typer.Exit(1)


def _megatron_logits(models, mesh, tokens):
    """Full-vocab logits [b, s, V] (padding dropped) on last-stage ranks, None elsewhere."""
    import torch
    import torch.distributed as dist
    from megatron.core.pipeline_parallel import get_forward_backward_func

    positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)

    def forward_step(data_iterator, model):
        output = model(tokens, positions, None)
        return output, lambda out: (out.sum() * 0, {"logits": out.detach()})

    results = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(()),
        model=models,
        num_microbatches=1,
        seq_length=tokens.shape[1],
        micro_batch_size=tokens.shape[0],
        forward_only=True,
    )
    if not mesh.is_last_stage:
        return None
    local = results[0]["logits"]  # [b, s, padded_vocab / tp]
    shards = [torch.empty_like(local) for _ in range(mesh.tp)]
    dist.all_gather(shards, local.contiguous(), group=mesh.tp_group)
    return torch.cat(shards, dim=-1)[..., : models[-1].unpadded_vocab_size]


def _run_verify(model: Path, *, tp: int, pp: int, tolerance: float) -> bool:
    from contextlib import ExitStack

    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    from parallel.convert import HFCheckpointReader, iter_hf_weights, load_hf_weights
    from parallel.cpu_compat import device
    from parallel.mesh import destroy_parallel, init_parallel
    from parallel.model import build_model

    mesh = init_parallel(tp=tp, pp=pp)
    hf_config = AutoConfig.from_pretrained(model)
    models = build_model(hf_config, mesh)
    load_hf_weights(models, mesh, model)

    batch, length = VERIFY_TOKENS
    length = min(length, hf_config.max_position_embeddings)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, hf_config.vocab_size, (batch, length), generator=generator)
    logits = _megatron_logits(models, mesh, tokens.to(device()))
    diff = None
    if logits is not None and mesh.tp_rank == 0:
        hf_model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        with torch.no_grad():
            diff = (logits.cpu().float() - hf_model(tokens).logits).abs().max().item()
    diff = mesh.broadcast_object_from_last_stage(diff)

    seen, mismatched = set(), []
    with ExitStack() as stack:
        reader = HFCheckpointReader(model, stack)
        for name, tensor in iter_hf_weights(models, mesh):
            seen.add(name)
            if mesh.rank == 0 and not torch.equal(tensor.cpu(), reader(name, None, 0, 0)):
                mismatched.append(name)
        missing = sorted(set(reader.weight_map) - seen)
    # Rank 0 (TP rank 0) holds the difference measured by the last stage of its pipeline.
    verdict = [diff is not None and diff <= tolerance, not mismatched and not missing]
    dist.broadcast_object_list(verdict, src=0)
    if mesh.rank == 0:
        typer.echo(f"layout tp={tp} pp={pp}: batch {batch}x{length} tokens")
        typer.echo(f"max |megatron - hf| logit difference: {diff:.3e} (tolerance {tolerance:g})")
        state = "exact" if verdict[1] else f"NOT exact: differ {mismatched}, missing {missing}"
        typer.echo(f"HF -> Megatron -> HF round trip of {len(seen)} tensors: {state}")
    destroy_parallel()
    return all(verdict)


def main() -> None:
    """`python -m rlcli.commands.convert ...` (also what the torchrun relaunch runs)."""
    try:
        convert_app()
    except UserError as error:
        typer.echo(f"error: {error}", err=True)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
