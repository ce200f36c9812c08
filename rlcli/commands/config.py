"""``rlcli config show|validate``: the resolved config of a recipe, and a check without a run."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from rlcli.commands.train import OVERRIDES, RECIPE

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
):
    """Check a recipe without running it; exit code 2 and a message naming the key if it is wrong."""
    from rlcli.validation.loader import load_config
    from rlcli.validation.validate import derive_dp, validate

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
