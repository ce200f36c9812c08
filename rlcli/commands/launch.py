"""``rlcli launch slurm|local``: start ``rlcli train`` under torchrun on a cluster or here."""

from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path
from typing import Optional

import typer

from rlcli.commands.relaunch import run_torchrun
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


def _configured(recipe: Path, overrides: list[str], key: str):
    """``key`` from the recipe and overrides (the ranks check the full config when the job
    starts; here only a few keys matter), None when neither sets it."""
    from omegaconf import OmegaConf

    try:
        merged = OmegaConf.merge(OmegaConf.load(recipe), OmegaConf.from_dotlist(overrides))
        return OmegaConf.select(merged, key)
    except Exception as err:  # not YAML, or an unresolvable value
        raise UserError(f"{recipe}: cannot read {key} ({err})") from None


def _configured_max_restarts(recipe: Path, overrides: list[str]) -> Optional[int]:
    value = _configured(recipe, overrides, "trainer.max_restarts")
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        raise UserError(f"{recipe}: trainer.max_restarts={value!r} is not a number") from None


def _configured_layout(recipe: Path, overrides: list[str], job: SlurmJob) -> str:
    """Which ranks train and which run engines (``rollout.placement=separate``); a UserError
    naming the key when the job's processes cannot hold that layout."""
    if _configured(recipe, overrides, "rollout.placement") != "separate":
        return rank_layout(job.nodes * job.processes_per_node, job.processes_per_node)
    try:
        num_ranks = int(_configured(recipe, overrides, "rollout.num_ranks") or 0)
        rollout_tp = int(_configured(recipe, overrides, "rollout.tp") or 1)
    except (TypeError, ValueError) as err:
        raise UserError(
            f"{recipe}: rollout.num_ranks / rollout.tp must be numbers ({err})"
        ) from None
    return rank_layout(
        job.nodes * job.processes_per_node, job.processes_per_node, num_ranks, rollout_tp
    )


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
) -> None:
    """Render an sbatch script that runs `rlcli train` under torchrun on every node; submit it."""
    recipe = _checked_recipe(recipe)
    if max_restarts is None:
        configured = _configured_max_restarts(recipe, overrides or [])
        max_restarts = DEFAULT_MAX_RESTARTS if configured is None else configured
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
        max_restarts=max_restarts,
    )
    program = train_program_args(recipe, validate_overrides(overrides or []))
    job.validate()  # (before the layout counts its processes)
    job = dataclasses.replace(job, layout=_configured_layout(recipe, overrides or [], job))
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
    """Run `rlcli train` under `torchrun --standalone` with --nproc ranks on this machine."""
    recipe = _checked_recipe(recipe)
    command = local_torchrun_command(
        nproc, train_program_args(recipe, validate_overrides(overrides or [])), max_restarts
    )
    if dry_run:
        typer.echo(shlex.join(command))
        return
    raise typer.Exit(run_torchrun(command))
