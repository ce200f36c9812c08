"""``rlcli launch slurm|local``: start ``rlcli train`` under torchrun on a cluster or here."""

from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path
from typing import Optional

import typer

from rlcli.commands.relaunch import ranks_use_vllm, run_torchrun
from rlcli.config.schema import RLConfig
from rlcli.errors import UserError
from rlcli.run.launch import (
    DEFAULT_MAX_RESTARTS,
    DEFAULT_SLURM_TEMPLATE,
    SlurmJob,
    local_torchrun_command,
    rank_layout,
    render_sbatch_script,
    submit_sbatch,
    train_program_args,
    validate_overrides,
    write_sbatch_script,
)

launch_app = typer.Typer(
    help="Start training on a Slurm cluster (sbatch) or on this machine (torchrun).",
    no_args_is_help=True,
)

RECIPE = typer.Argument(..., help="Recipe YAML, e.g. recipes/grpo_qwen7b.yaml")
OVERRIDES = typer.Argument(None, help="Dot-list overrides, e.g. actor.lr=1e-5 parallel.tp=2")


def _checked_recipe(recipe: Path) -> Path:
    if not recipe.is_file():
        raise UserError(f"recipe {recipe} not found (give the path of a recipe YAML file).")
    return recipe


def _default_job_name(recipe: Path) -> str:
    # #SBATCH lines are not shell-quoted: keep the recipe's name to safe characters.
    return "rlcli-" + re.sub(r"[^A-Za-z0-9_.-]", "_", recipe.stem)


def _checked_config(recipe: Path, overrides: list[str], world_size: int) -> RLConfig:
    """The config the ranks will load, checked now as ``rlcli config validate --world-size``
    does: a typo or a layout the job cannot hold fails here, not after the job waited in the
    queue. (Model folders and data files are not looked up: they may live only on the
    cluster.)"""
    from rlcli.validation.loader import load_config
    from rlcli.validation.validate import validate

    cfg = load_config(recipe, validate_overrides(overrides))
    validate(cfg, world_size=world_size)
    return cfg


def _layout(cfg: RLConfig, job: SlurmJob) -> str:
    """Which ranks train and which run engines (``rollout.placement=separate``); a UserError
    naming the key when the job's processes cannot hold that layout."""
    world = job.nodes * job.processes_per_node
    if not cfg.rollout.is_separate:
        return rank_layout(world, job.processes_per_node)
    return rank_layout(world, job.processes_per_node, cfg.rollout.num_ranks, cfg.rollout.tp)


@launch_app.command("slurm")
def launch_slurm(
    recipe: Path = RECIPE,
    overrides: Optional[list[str]] = OVERRIDES,
    nodes: int = typer.Option(1, "--nodes", help="Nodes to allocate."),
    gpus_per_node: int = typer.Option(8, "--gpus-per-node", help="GPUs per node (0: CPU job)."),
    nproc_per_node: Optional[int] = typer.Option(
        None, "--nproc-per-node", help="Ranks per node (default: --gpus-per-node)."
    ),
    partition: Optional[str] = typer.Option(None, "--partition", help="Slurm partition."),
    time: Optional[str] = typer.Option(
        None, "--time", help="Time limit, HH:MM:SS or D-HH:MM:SS (default: the partition's)."
    ),
    account: Optional[str] = typer.Option(None, "--account", help="Slurm account to charge."),
    cpus_per_task: Optional[int] = typer.Option(
        None, "--cpus-per-task", help="CPUs for each node's torchrun (all its ranks)."
    ),
    job_name: Optional[str] = typer.Option(
        None, "--job-name", help="Job name (default: rlcli-<recipe name>)."
    ),
    sbatch_option: Optional[list[str]] = typer.Option(
        None,
        "--sbatch-option",
        help="Extra #SBATCH flag, repeatable, e.g. --sbatch-option=--qos=high",
    ),
    log_dir: Path = typer.Option(
        Path("slurm_logs"), "--log-dir", help="Where the job writes <name>-<jobid>.out."
    ),
    template: Path = typer.Option(DEFAULT_SLURM_TEMPLATE, "--template", help="sbatch template."),
    output: Optional[Path] = typer.Option(
        None, "--output", help="Where to write the script (default: <log-dir>/<job-name>.sbatch)."
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Print the script (and write it only if --output is given)."
    ),
    max_restarts: Optional[int] = typer.Option(
        None,
        "--max-restarts",
        help="torchrun restarts after a rank dies (default: trainer.max_restarts, else 3).",
    ),
    network_interface: Optional[str] = typer.Option(
        None,
        "--network-interface",
        help="NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME for the job, e.g. ib0 (default: detected "
        "on the first node).",
    ),
) -> None:
    """Render an sbatch script that runs `rlcli train` under torchrun on every node; submit it.
    The recipe and overrides are checked first, for the job's number of ranks."""
    recipe = _checked_recipe(recipe)
    job = SlurmJob(
        job_name=job_name or _default_job_name(recipe),
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        nproc_per_node=nproc_per_node,
        time=time,
        partition=partition,
        account=account,
        cpus_per_task=cpus_per_task,
        log_dir=log_dir,
        sbatch_options=tuple(sbatch_option or ()),
        network_interface=network_interface,
    )
    job.validate()  # (before the layout counts its processes)
    cfg = _checked_config(recipe, overrides or [], job.nodes * job.processes_per_node)
    if max_restarts is None:
        configured = cfg.trainer.max_restarts
        max_restarts = DEFAULT_MAX_RESTARTS if configured is None else configured
    job = dataclasses.replace(job, max_restarts=max_restarts, layout=_layout(cfg, job))
    job.validate()
    program = train_program_args(recipe, list(overrides or []))
    script = render_sbatch_script(job, program, template=template)
    if dry_run:
        typer.echo(script, nl=False)
        if output is not None:
            write_sbatch_script(script, output)
        return
    script_path = write_sbatch_script(script, output or log_dir / f"{job.job_name}.sbatch")
    job_id = submit_sbatch(script_path)
    typer.echo(
        f"submitted job {job_id} ({script_path}); log: {log_dir.resolve()}/{job.job_name}-{job_id}.out"
    )


@launch_app.command("local")
def launch_local(
    recipe: Path = RECIPE,
    overrides: Optional[list[str]] = OVERRIDES,
    nproc: int = typer.Option(..., "--nproc", help="Processes (ranks) to start on this machine."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the torchrun command only."),
    max_restarts: int = typer.Option(
        0, "--max-restarts", help="Restarts of the group after a rank dies (it then resumes)."
    ),
) -> None:
    """Run `rlcli train` under `torchrun --standalone` with --nproc ranks on this machine (the
    recipe and overrides checked first, for --nproc ranks)."""
    recipe = _checked_recipe(recipe)
    if nproc < 1:
        raise UserError(f"--nproc must be at least 1, got {nproc}.")
    cfg = _checked_config(recipe, overrides or [], nproc)
    command = local_torchrun_command(
        nproc, train_program_args(recipe, list(overrides or [])), max_restarts
    )
    if dry_run:
        typer.echo(shlex.join(command))
        return
    raise typer.Exit(run_torchrun(command, stop_after_step=True, with_vllm=ranks_use_vllm(cfg)))
