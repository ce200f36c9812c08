"""``rlcli rm RECIPE [overrides] [--nproc N]``: train a reward model on preference pairs
(``rm.*``; the work is ``rlcli.train.reward_model``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import typer

from rlcli.commands.relaunch import relaunch_under_torchrun, under_torchrun, without_nproc
from rlcli.errors import UserError

RECIPE = typer.Argument(
    ..., help="Recipe YAML with an rm section, e.g. recipes/rlhf_quickstart.yaml"
)
OVERRIDES = typer.Argument(None, help="Dot-list overrides, e.g. rm.lr=1e-5 rm.steps=200")
NPROC = typer.Option(
    1, "--nproc", help="Processes to start on this machine with torchrun (ignored under torchrun)."
)


def rm(recipe: Path = RECIPE, overrides: Optional[list[str]] = OVERRIDES, nproc: int = NPROC):
    """Train a reward model (Bradley-Terry loss on pairwise preference rows) and write it as an
    HF *ForSequenceClassification folder (rm.out_dir)."""
    from rlcli.validation.loader import load_config
    from rlcli.validation.rewards import check_reward_model_training
    from rlcli.validation.validate import derive_dp, validate

    cfg = load_config(recipe, overrides or [])
    if under_torchrun():
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    elif nproc < 1:
        raise UserError(f"--nproc must be >= 1, got {nproc}")
    else:
        world_size = nproc
    validate(cfg, world_size=world_size)
    check_reward_model_training(cfg, derive_dp(cfg.parallel, world_size))
    if cfg.rm.on_policy_samples:
        raise UserError(
            f"rm.on_policy_samples={cfg.rm.on_policy_samples}: only rlcli train samples the RL "
            "start policy for pairs (rm.before_rl=true); for rlcli rm set rm.on_policy_samples=0 "
            "and give the pairs as rm.train_files"
        )
    if nproc != 1 and not under_torchrun():
        relaunch_under_torchrun(nproc, without_nproc(sys.argv[1:]))

    from parallel.mesh import destroy_parallel, init_parallel
    from rlcli.train.inputs import model_options
    from rlcli.train.reward_model import train_reward_model

    mesh = init_parallel(
        cfg.parallel.tp,
        cfg.parallel.pp,
        cfg.parallel.vpp,
        seed=cfg.trainer.seed,
        timeout_s=cfg.parallel.timeout_minutes * 60,
    )
    report = train_reward_model(
        cfg,
        mesh,
        model_options(cfg, cfg.actor),
        log=lambda message: print(f"[rlcli] {message}", flush=True),
    )
    if mesh.rank == 0:
        before, after = report.val_accuracy_before, report.val_accuracy_after
        if after is not None:
            shown = "n/a" if before is None else f"{before:.1%}"
            typer.echo(
                f"held-out pairwise accuracy: {shown} -> {after:.1%} ({report.val_pairs} pairs)"
            )
    destroy_parallel()
