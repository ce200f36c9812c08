"""``rlcli train`` and ``rlcli sft``: load and check the config, start torchrun for ``--nproc N``,
then hand the config to the trainer.

Heavy imports (torch, megatron-core, vLLM) happen inside the commands, so ``rlcli --help`` stays
fast.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Optional

import typer

from rlcli.commands.relaunch import (
    ranks_use_vllm,
    relaunch_under_torchrun,
    under_torchrun,
    without_nproc,
)
from rlcli.config.schema import RLConfig
from rlcli.errors import UserError
from rlcli.machine import make_repeatable

RECIPE = typer.Argument(..., help="Recipe YAML, e.g. recipes/quickstart.yaml")
OVERRIDES = typer.Argument(None, help="Dot-list overrides, e.g. actor.lr=1e-5 parallel.tp=2")
NPROC = typer.Option(
    1, "--nproc", help="Processes to start on this machine with torchrun (ignored under torchrun)."
)
MAX_RESTARTS = typer.Option(
    None,
    "--max-restarts",
    help="With --nproc: restarts of the whole group after a rank dies; the run resumes from its "
    "newest checkpoint (default: trainer.max_restarts, else 0).",
)


def train(
    recipe: Path = RECIPE,
    overrides: Optional[list[str]] = OVERRIDES,
    nproc: int = NPROC,
    max_restarts: Optional[int] = MAX_RESTARTS,
):
    """Run RL post-training (GRPO, DAPO, PPO, ...) as the recipe says."""
    cfg = _load_for_run(recipe, overrides, nproc, max_restarts, resumes=True)
    from rlcli.train.build import run_role

    run_role(cfg)  # the trainer (and with rollout.placement=separate, the rollout ranks' loop)


def sft(recipe: Path = RECIPE, overrides: Optional[list[str]] = OVERRIDES, nproc: int = NPROC):
    """Supervised warm start: cross-entropy on the responses of the recipe's SFT data."""
    cfg = _load_for_run(recipe, overrides, nproc)
    from rlcli.train.build import run_sft_only

    run_sft_only(cfg)


def _load_for_run(
    recipe: Path,
    overrides: Optional[list[str]],
    nproc: int,
    max_restarts: Optional[int] = None,
    resumes: bool = False,
) -> RLConfig:
    """The validated config, checked against the number of processes and the model folder;
    with ``--nproc N`` outside torchrun, this command is first run again under torchrun on N
    local processes (each of which loads the config again) and this process exits with their
    outcome. ``resumes``: say first what happens to a run the output folder already holds
    (``rlcli.run.resume_plan``): refused settings, nothing to do, or a resume."""
    from rlcli.validation.loader import load_config

    cfg = load_config(recipe, overrides or [])
    if under_torchrun():
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    else:
        if nproc < 1:
            raise UserError(f"--nproc must be >= 1, got {nproc}")
        _check_process_count(cfg, nproc)
        world_size = nproc
    from rlcli.validation.rewards import check_reward_model_dirs, check_reward_model_training
    from rlcli.validation.validate import derive_dp, validate

    validate(cfg, world_size=world_size)
    if cfg.trainer.deterministic:
        make_repeatable()
    check_model_dir(cfg)
    resolve_hub_data(cfg)
    check_prompt_files(cfg)
    check_reward_model_dirs(cfg)
    if cfg.rm.before_rl:
        check_reward_model_training(cfg, derive_dp(cfg.parallel, world_size))
    relaunching = nproc != 1 and not under_torchrun()
    if resumes:
        _say_resume_plan(cfg, relaunching)
    if relaunching:
        restarts = max_restarts if max_restarts is not None else cfg.trainer.max_restarts or 0
        if restarts < 0:
            raise UserError(f"--max-restarts must be >= 0, got {restarts}")
        # (`rlcli train`'s ranks stop after a step when asked: `resumes` is true for it alone)
        relaunch_under_torchrun(
            nproc, without_nproc(sys.argv[1:]), restarts, resumes, ranks_use_vllm(cfg)
        )
    return cfg


def _say_resume_plan(cfg: RLConfig, relaunching: bool) -> None:
    """Refuse, or say "nothing to do" and exit 0, or say what the resume changes (once: by the
    relaunched rank 0 when this process starts torchrun)."""
    from rlcli.run.resume_plan import plan_resume

    plan = plan_resume(cfg)
    if plan is None:
        return
    if int(os.environ.get("RANK", "0")) == 0 and (plan.nothing_to_do or not relaunching):
        typer.echo(f"[rlcli] {plan.message}")
    if plan.nothing_to_do:
        raise typer.Exit(0)


def _check_process_count(cfg: RLConfig, nproc: int) -> None:
    """Name ``--nproc`` when the layout needs more processes than this command starts."""
    par, r = cfg.parallel, cfg.rollout
    if r.is_separate:
        trainers = nproc - r.num_ranks
        if trainers < 1 or trainers % (par.tp * par.pp):
            need = r.num_ranks + par.tp * par.pp
            raise UserError(
                f"rollout.num_ranks={r.num_ranks} rollout ranks and parallel.tp={par.tp} x "
                f"parallel.pp={par.pp} trainer ranks need rollout.num_ranks plus a multiple of "
                f"{par.tp * par.pp} processes and this command starts {nproc}: add --nproc {need} "
                "(or start it under torchrun)"
            )
        return
    need = math.lcm(par.tp * par.pp, r.tp)
    if nproc % need:
        raise UserError(
            f"parallel.tp={par.tp} x parallel.pp={par.pp} (rollout.tp={cfg.rollout.tp}) needs a "
            f"multiple of {need} processes and this command starts {nproc}: add --nproc {need} "
            "(or start it under torchrun)"
        )


def check_model_dir(cfg: RLConfig) -> None:
    """model.path must be an HF folder rlcli can load (or a Hugging Face Hub id, resolved to its
    local snapshot: ``rlcli.model.hub``), and the settings that depend on the model must fit its
    config.json. With model.build the builder writes it (and under torchrun rank 0
    may be writing it right now): it is a dense model of model.spec (with a vision tower for
    qwen2_5_vl)."""
    import json

    from rlcli.validation.model import validate_against_model

    if cfg.model.build:
        if cfg.data.synthetic is None and not Path(cfg.model.path, "config.json").exists():
            raise UserError(
                "model.build needs text to train its tokenizer: use data.synthetic=arith, "
                "tool_multiply or count_squares"
            )
        built = {"model_type": cfg.model.spec.architecture}
        if cfg.model.spec.architecture == "qwen2_5_vl":
            built["vision_config"] = {}
        validate_against_model(cfg, built)
        return
    from rlcli.model.hub import resolve_model_path

    # A Hugging Face Hub id becomes its local snapshot folder here, for everything after.
    cfg.model.path = resolve_model_path(cfg.model.path)
    if cfg.model.tokenizer_path:
        cfg.model.tokenizer_path = resolve_model_path(
            cfg.model.tokenizer_path, "model.tokenizer_path"
        )
    path = Path(cfg.model.path)
    from parallel.convert import hf_model_dir_problem

    problem = hf_model_dir_problem(path)
    if problem is not None:
        raise UserError(f"model.path={cfg.model.path}: {problem}")
    validate_against_model(cfg, json.loads((path / "config.json").read_text()))


def check_prompt_files(cfg: RLConfig) -> None:
    """The rows of the prompt files the config names, checked here, before the training stack is
    imported: a bad row exits 2 in a second instead of after every rank's imports (5-10 s).
    Prompt length needs the tokenizer: the ranks check it when they load the data. Synthetic
    data the run writes itself is not there yet."""
    from rlcli.data.dataset import read_prompt_rows

    for files in (cfg.data.train_files, cfg.data.val_files):
        if files:
            read_prompt_rows(files, cfg.data.prompt_key)


def resolve_hub_data(cfg: RLConfig) -> None:
    """Data entries given as Hugging Face Hub dataset ids (``org/name:split``) become the local
    files of that split (``rlcli.data.hub``), for everything after."""
    from rlcli.data.hub import dataset_files

    for key, section, name in (
        ("data.train_files", cfg.data, "train_files"),
        ("data.val_files", cfg.data, "val_files"),
        ("sft.train_files", cfg.sft, "train_files"),
    ):
        entries = getattr(section, name)
        setattr(section, name, [f for entry in entries for f in dataset_files(entry, key)])
