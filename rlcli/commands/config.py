"""``rlcli config show|validate``: the resolved config of a recipe, and a check without a run."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from rlcli.commands.train import OVERRIDES, RECIPE
from rlcli.config.schema import RLConfig
from rlcli.errors import UserError

config_app = typer.Typer(help="Show or validate a recipe's resolved config.", no_args_is_help=True)


@config_app.command("show")
def config_show(recipe: Path = RECIPE, overrides: Optional[list[str]] = OVERRIDES):
    """Print the fully resolved config (defaults <- recipe <- overrides)."""
    from rlcli.config.schema import to_yaml
    from rlcli.validation.loader import load_config

    typer.echo(to_yaml(load_config(recipe, overrides or [])), nl=False)


@config_app.command("validate")
def config_validate(
    recipe: Path = RECIPE,
    overrides: Optional[list[str]] = OVERRIDES,
    world_size: Optional[int] = typer.Option(
        None, "--world-size", help="Also check the parallel layout for this many ranks."
    ),
    no_files: bool = typer.Option(
        False,
        "--no-files",
        help="Do not look up the model folder and data files (they live on the cluster).",
    ),
):
    """Check a recipe without running it: its keys and values, the model folder and the data
    files it names; exit code 2 and a message naming the key if it is wrong."""
    from rlcli.validation.loader import load_config
    from rlcli.validation.validate import derive_dp, validate

    cfg = load_config(recipe, overrides or [])
    if not no_files:
        check_files_exist(cfg)
    if world_size is not None:
        validate(cfg, world_size=world_size)
        dp = derive_dp(cfg.parallel, world_size)
        typer.echo(
            f"ok: {recipe} (world size {world_size}: tp={cfg.parallel.tp} "
            f"pp={cfg.parallel.pp} dp={dp}, rollout.tp={cfg.rollout.tp})"
        )
    else:
        typer.echo(f"ok: {recipe}")


def check_files_exist(cfg: RLConfig) -> None:
    """The model folder (unless ``model.build`` makes it) and every data file the config names
    must be there; a UserError names the key and the path."""
    from rlcli.commands.train import check_model_dir, resolve_hub_data

    check_model_dir(cfg)
    resolve_hub_data(cfg)
    named = {
        "data.train_files": cfg.data.train_files,
        "data.val_files": cfg.data.val_files,
        "sft.train_files": cfg.sft.train_files,
    }
    for key, files in named.items():
        missing = [name for name in files if not Path(name).is_file()]
        if missing:
            raise UserError(
                f"{key}: {', '.join(missing)} not found (from {Path.cwd()}); prepare the data "
                "first (`rlcli data --help`) or fix the path (--no-files skips this check when "
                "the files live on the cluster)"
            )
