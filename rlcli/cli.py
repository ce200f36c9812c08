"""The ``rlcli`` command line: train, sft, config, convert, data, export, launch.

Heavy imports (torch, megatron-core, vLLM) happen inside the commands, so ``rlcli --help`` and
``rlcli config show`` answer in a fraction of a second.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import typer

from rlcli.commands.convert import convert_app
from rlcli.commands.launch import launch_app
from rlcli.errors import USER_ERROR_EXIT_CODE, UserError

app = typer.Typer(
    help="rlcli: Megatron-centric RL post-training for LLMs with colocated vLLM rollouts.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
config_app = typer.Typer(help="Show or validate a recipe's resolved config.", no_args_is_help=True)
data_app = typer.Typer(
    help="Prepare datasets in the prompt schema rlcli trains on.", no_args_is_help=True
)
app.add_typer(config_app, name="config")
app.add_typer(data_app, name="data")
app.add_typer(launch_app, name="launch")
app.add_typer(convert_app, name="convert")

RECIPE = typer.Argument(..., help="Recipe YAML, e.g. recipes/quickstart.yaml")
OVERRIDES = typer.Argument(None, help="Dot-list overrides, e.g. actor.lr=1e-5 parallel.tp=2")
NPROC = typer.Option(
    1, "--nproc", help="Processes to start on this machine with torchrun (ignored under torchrun)."
)


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def _load_under_torchrun(recipe: Path, overrides: Optional[list[str]], nproc: int):
    """The validated config; with ``--nproc N`` outside torchrun, first re-execute this very
    command under torchrun on N local processes (each of which loads the config again)."""
    from rlcli.config_loader import load_config

    cfg = load_config(recipe, overrides or [])
    if nproc != 1 and not _under_torchrun():
        from rlcli.launch import local_torchrun_command

        cmd = local_torchrun_command(nproc, ["-m", "rlcli.cli", *_without_nproc(sys.argv[1:])])
        os.execv(cmd[0], cmd)
    return cfg


def _without_nproc(argv: list[str]) -> list[str]:
    """The command line minus ``--nproc N``: torchrun's own parser would take ``--nproc`` for an
    abbreviation of its ``--nproc-per-node`` (and it is meaningless under torchrun anyway)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


@app.command()
def train(recipe: Path = RECIPE, overrides: Optional[list[str]] = OVERRIDES, nproc: int = NPROC):
    """Run RL post-training (GRPO, DAPO, PPO, ...) as the recipe says."""
    cfg = _load_under_torchrun(recipe, overrides, nproc)
    from rlcli.loop import run_training

    run_training(cfg)


@app.command()
def sft(recipe: Path = RECIPE, overrides: Optional[list[str]] = OVERRIDES, nproc: int = NPROC):
    """Supervised warm start: cross-entropy on the responses of the recipe's SFT data."""
    cfg = _load_under_torchrun(recipe, overrides, nproc)
    from rlcli.loop import run_sft_only

    run_sft_only(cfg)


@app.command()
def export(
    checkpoint: Path = typer.Argument(
        ..., help="A checkpoint folder, e.g. outputs/run/checkpoints/step_000100"
    ),
    out: Path = typer.Option(
        ..., "--out", help="Output HF model folder (safetensors + config + tokenizer)."
    ),
):
    """Write a training checkpoint's policy as a HuggingFace model directory."""
    from rlcli.checkpointing import is_complete_checkpoint
    from rlcli.commands.convert import mcore_to_hf

    if not is_complete_checkpoint(checkpoint):
        raise UserError(f"{checkpoint} is not a complete rlcli checkpoint (no COMPLETE marker)")
    mcore_to_hf(ckpt=checkpoint, out=out, tp=1, pp=1, hf_config_dir=None)


@config_app.command("show")
def config_show(recipe: Path = RECIPE, overrides: Optional[list[str]] = OVERRIDES):
    """Print the fully resolved config (defaults <- recipe <- overrides)."""
    from rlcli.config import to_yaml
    from rlcli.config_loader import load_config

    typer.echo(to_yaml(load_config(recipe, overrides or [])), nl=False)


@config_app.command("validate")
def config_validate(
    recipe: Path = RECIPE,
    overrides: Optional[list[str]] = OVERRIDES,
    world_size: Optional[int] = typer.Option(
        None, "--world-size", help="Also check the parallel layout for this many ranks."
    ),
):
    """Check a recipe without running it; exit code 2 and a message naming the key if it is wrong."""
    from rlcli.config_loader import load_config
    from rlcli.config_validation import derive_dp, validate

    cfg = load_config(recipe, overrides or [])
    if world_size is not None:
        validate(cfg, world_size=world_size)
        dp = derive_dp(cfg.parallel, world_size)
        typer.echo(
            f"ok: {recipe} (world size {world_size}: tp={cfg.parallel.tp} "
            f"pp={cfg.parallel.pp} dp={dp}, rollout.tp={cfg.rollout.tp})"
        )
    else:
        typer.echo(f"ok: {recipe}")


@data_app.command("gsm8k")
def data_gsm8k(
    input: Path = typer.Option(..., "--input", help="GSM8K raw JSONL (question / answer rows)."),
    output: Path = typer.Option(..., "--output", help="Output directory."),
):
    """Turn GSM8K's raw rows into rlcli's (verl's) prompt schema."""
    from rlcli.data.gsm8k import convert_gsm8k

    counts = convert_gsm8k(str(input), str(output))
    typer.echo(f"wrote {output}: {counts}")


@data_app.command("arith")
def data_arith(
    output: Path = typer.Option(..., "--output", help="Output directory."),
    num_max: int = typer.Option(50, help="Operands are drawn from 0..num_max-1."),
    num_val: int = typer.Option(200, help="Held-out pairs."),
):
    """Write the quickstart's synthetic addition task (train and held-out JSONL)."""
    from rlcli.data.synthetic import write_arith_dataset

    paths = write_arith_dataset(str(output), num_max=num_max, num_val=num_val)
    typer.echo(f"wrote {paths}")


def _quiet_third_party_noise() -> None:
    """Keep the console for rlcli's own progress: vLLM logs INFO lines (and a harmless chat-template
    warmup traceback when the tokenizer has no template) by default, and megatron-core warns at
    import that optional fused kernels (apex, Transformer Engine) are absent. Users can still ask
    for vLLM's logs with VLLM_LOGGING_LEVEL."""
    import warnings

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    for pattern in (
        r".*(Apex|Transformer Engine).*not installed.*",
        r".*full scope is deprecated.*",
    ):
        warnings.filterwarnings("ignore", message=pattern)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: user mistakes print one clear line and exit 2, never a traceback."""
    _quiet_third_party_noise()
    try:
        app(args=argv, standalone_mode=False)
    except UserError as err:
        typer.secho(f"error: {err}", err=True, fg=typer.colors.RED)
        sys.exit(USER_ERROR_EXIT_CODE)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)
    except typer.Exit as err:
        sys.exit(err.exit_code)
    except typer.Abort:
        sys.exit(1)
    except Exception as err:  # click usage errors carry their own exit code (2)
        import click

        if isinstance(err, click.ClickException):
            err.show()
            sys.exit(err.exit_code)
        raise


if __name__ == "__main__":
    main()
