"""Starting a training run on many processes: an sbatch script for Slurm, or torchrun here.

Both run the same SPMD program under ``torchrun``; on Slurm one ``srun`` task per node starts one
``torchrun``, which starts ``nproc_per_node`` ranks and meets the other nodes through a c10d
rendezvous on the allocation's first node.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import jinja2

from rlcli.errors import UserError

SLURM_TEMPLATE_DIR = Path(__file__).resolve().parents[2] / "recipes" / "slurm"
DEFAULT_SLURM_TEMPLATE = SLURM_TEMPLATE_DIR / "torchrun.sbatch.j2"

# Slurm's --time forms we accept: [days-]hours:minutes:seconds.
_SLURM_TIME_RE = re.compile(r"^(?:(\d+)-)?(\d{1,3}):(\d{2}):(\d{2})$")
# Names that end up on an #SBATCH line, which Slurm reads without any shell quoting.
_SBATCH_WORD_RE = re.compile(r"^[A-Za-z0-9_.,:@+=/%-]+$")
# torchrun restarts of a multi-node job (a node's failure restarts every rank; training then
# resumes from its last checkpoint).
DEFAULT_MAX_RESTARTS = 3


def torchrun_prefix() -> list[str]:
    """``torchrun`` as this interpreter runs it (no reliance on PATH on the compute nodes)."""
    return [sys.executable, "-m", "torch.distributed.run"]


def train_program_args(recipe: str | os.PathLike[str], overrides: Sequence[str]) -> list[str]:
    """What torchrun runs for training: ``-m rlcli.cli train RECIPE key=value ...``."""
    return ["-m", "rlcli.cli", "train", str(Path(recipe).resolve()), *overrides]


def validate_slurm_time(value: str) -> str:
    """Checks a ``--time`` value (``HH:MM:SS`` or ``D-HH:MM:SS``) and returns it."""
    match = _SLURM_TIME_RE.match(value)
    if match is None or int(match.group(3)) >= 60 or int(match.group(4)) >= 60:
        raise UserError(
            f"--time {value!r} is not a time limit; use HH:MM:SS or D-HH:MM:SS "
            "(e.g. 04:00:00 or 1-12:00:00)."
        )
    return value


def validate_overrides(overrides: Sequence[str]) -> list[str]:
    """Each override must look like ``key=value`` (the config loader checks the key itself)."""
    for override in overrides:
        key, separator, _ = override.partition("=")
        if not separator or not key or " " in key:
            raise UserError(
                f"override {override!r} is not key=value (e.g. trainer.total_steps=100); "
                "put options such as --nodes before or after the overrides, not between "
                "a key and its value."
            )
    return list(overrides)


def _validate_sbatch_word(option: str, value: str | None) -> None:
    if value is not None and not _SBATCH_WORD_RE.match(value):
        raise UserError(
            f"{option} {value!r} has characters an #SBATCH line cannot carry "
            "(use letters, digits and _ . , : @ + = / % -)."
        )


def _validate_positive(option: str, value: int | None, minimum: int = 1) -> None:
    if value is not None and value < minimum:
        raise UserError(f"{option} must be at least {minimum}, got {value}.")


@dataclass(frozen=True)
class SlurmJob:
    """The resources and names of one sbatch job.

    ``gpus_per_node`` may be 0 for CPU clusters; ``nproc_per_node`` defaults to it (one rank per
    GPU). ``sbatch_options`` are extra ``#SBATCH`` flags such as ``--qos=high``.
    ``network_interface`` (None: detected in the script) becomes NCCL_SOCKET_IFNAME and
    GLOO_SOCKET_IFNAME; ``max_restarts`` is torchrun's; ``requeue`` asks Slurm for USR1
    ``signal_seconds`` before preemption / the time limit and requeues the job then.
    """

    job_name: str
    nodes: int = 1
    gpus_per_node: int = 8
    nproc_per_node: int | None = None
    time: str | None = None
    partition: str | None = None
    account: str | None = None
    cpus_per_task: int | None = None
    log_dir: Path = Path("slurm_logs")
    workdir: Path = field(default_factory=Path.cwd)
    sbatch_options: tuple[str, ...] = ()
    network_interface: str | None = None
    max_restarts: int = DEFAULT_MAX_RESTARTS
    requeue: bool = True
    signal_seconds: int = 120
    layout: str = "every rank trains and runs a colocated engine"  # see rank_layout

    @property
    def processes_per_node(self) -> int:
        return self.gpus_per_node if self.nproc_per_node is None else self.nproc_per_node

    def validate(self) -> None:
        """Raises :class:`UserError` naming the command-line option that is wrong."""
        _validate_positive("--nodes", self.nodes)
        _validate_positive("--gpus-per-node", self.gpus_per_node, minimum=0)
        _validate_positive("--nproc-per-node", self.nproc_per_node)
        _validate_positive("--cpus-per-task", self.cpus_per_task)
        _validate_positive("--max-restarts", self.max_restarts, minimum=0)
        _validate_sbatch_word("--network-interface", self.network_interface)
        if self.processes_per_node < 1:
            raise UserError(
                "--gpus-per-node is 0 (a CPU job): give --nproc-per-node, the processes per node."
            )
        if self.time is not None:
            validate_slurm_time(self.time)
        _validate_sbatch_word("--job-name", self.job_name)
        _validate_sbatch_word("--partition", self.partition)
        _validate_sbatch_word("--account", self.account)
        _validate_sbatch_word("--log-dir", str(self.log_dir.resolve()))
        for option in self.sbatch_options:
            if not option.startswith("--") or "\n" in option:
                raise UserError(f"--sbatch-option {option!r} must be one flag like --qos=high.")


def render_sbatch_script(
    job: SlurmJob,
    program_args: Sequence[str],
    template: str | os.PathLike[str] = DEFAULT_SLURM_TEMPLATE,
) -> str:
    """The sbatch script that runs ``torchrun <rendezvous options> <program_args>`` on every node.

    ``program_args`` is what follows torchrun's own options: a script path and its arguments, or
    ``-m module ...`` (see :func:`train_program_args`).
    """
    job.validate()
    template_path = Path(template)
    if not template_path.is_file():
        raise UserError(f"sbatch template {template_path} not found; pass --template FILE.")
    environment = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(template_path.parent)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )
    return environment.get_template(template_path.name).render(
        template_name=template_path.name,
        job_name=job.job_name,
        nodes=job.nodes,
        gpus_per_node=job.gpus_per_node,
        nproc_per_node=job.processes_per_node,
        cpus_per_task=job.cpus_per_task,
        partition=job.partition,
        account=job.account,
        time=job.time,
        log_dir=str(job.log_dir.resolve()),
        sbatch_options=list(job.sbatch_options),
        network_interface=job.network_interface,
        max_restarts=job.max_restarts,
        requeue=job.requeue,
        signal_seconds=job.signal_seconds,
        layout=job.layout,
        workdir=shlex.quote(str(job.workdir.resolve())),
        torchrun=shlex.join(torchrun_prefix()),
        program=shlex.join(program_args),
    )


def rank_layout(
    total: int, ranks_per_node: int, rollout_ranks: int = 0, rollout_tp: int = 1
) -> str:
    """How a job's ``total`` ranks split into trainer and rollout ranks (the last
    ``rollout_ranks`` of the global order, ``rollout.placement=separate``), as one line for the
    job's log; a UserError naming the key when the split is impossible or an engine's
    ``rollout_tp`` ranks would straddle two nodes (vLLM's tensor parallelism wants one node)."""
    if not rollout_ranks:
        return "every rank trains and runs a colocated engine"
    trainers = total - rollout_ranks
    if rollout_ranks < 0 or trainers < 1:
        raise UserError(
            f"rollout.num_ranks={rollout_ranks} leaves no trainer rank among the job's {total} "
            "processes: lower it or add nodes"
        )
    if rollout_ranks % rollout_tp:
        raise UserError(
            f"rollout.num_ranks={rollout_ranks} is not divisible by rollout.tp={rollout_tp}"
        )
    for first in range(trainers, total, rollout_tp):
        if first // ranks_per_node != (first + rollout_tp - 1) // ranks_per_node:
            raise UserError(
                f"an engine of rollout.tp={rollout_tp} would span two nodes (ranks {first}-"
                f"{first + rollout_tp - 1}, {ranks_per_node} per node): choose rollout.num_ranks "
                "so that the trainer ranks fill whole nodes, or a rollout.tp that divides "
                "--nproc-per-node"
            )
    return (
        f"ranks 0-{trainers - 1} train, ranks {trainers}-{total - 1} run "
        f"{rollout_ranks // rollout_tp} engine(s) of rollout.tp={rollout_tp}"
    )


def write_sbatch_script(script: str, path: str | os.PathLike[str]) -> Path:
    """Writes the script, and creates the folder of its ``#SBATCH --output`` log: Slurm does not,
    and a job whose log folder is missing fails without a word."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    log_match = re.search(r"^#SBATCH --output=(\S+)$", script, flags=re.MULTILINE)
    if log_match is not None:
        Path(log_match.group(1)).parent.mkdir(parents=True, exist_ok=True)
    path.write_text(script, encoding="utf-8")
    path.chmod(0o755)
    return path


def submit_sbatch(script_path: str | os.PathLike[str], env: Mapping[str, str] | None = None) -> str:
    """Submits the script with ``sbatch`` and returns the job id."""
    if shutil.which("sbatch", path=(env or os.environ).get("PATH")) is None:
        raise UserError("sbatch is not on PATH: run this on a Slurm login node, or use --dry-run.")
    completed = subprocess.run(
        ["sbatch", "--parsable", str(script_path)],
        capture_output=True,
        text=True,
        env=None if env is None else dict(env),
        check=False,
    )
    if completed.returncode != 0:
        raise UserError(f"sbatch rejected {script_path}: {completed.stderr.strip()}")
    # --parsable prints "jobid" or "jobid;cluster".
    return completed.stdout.strip().split(";")[0]


def local_torchrun_command(
    nproc: int, program_args: Sequence[str], max_restarts: int = 0
) -> list[str]:
    """``torchrun --standalone --nproc_per_node N --max-restarts R <program_args>`` for one
    machine. Locally R defaults to 0: a failure here is usually a bug or a config error, which
    a restart would only repeat."""
    _validate_positive("--nproc", nproc)
    _validate_positive("--max-restarts", max_restarts, minimum=0)
    return [
        *torchrun_prefix(),
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        "--max-restarts",
        str(max_restarts),
        *program_args,
    ]
