"""Real sbatch submissions to a one-node Slurm cluster on localhost.

``start_local_slurm.sh`` starts slurmctld, slurmd (and munged) unless they already run; the daemons
this module started are stopped at its end.
"""

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlcli.commands.launch import launch_app
from rlcli.run.launch import SlurmJob, render_sbatch_script, submit_sbatch, write_sbatch_script

HERE = Path(__file__).resolve().parent
START_SCRIPT = HERE / "start_local_slurm.sh"
ALLREDUCE_SCRIPT = HERE / "allreduce_check.py"
TERMINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(
        shutil.which("slurmctld") is None or shutil.which("munged") is None or os.geteuid() != 0,
        reason="needs root, slurmctld and munged "
        "(apt-get install -y --no-install-recommends slurm-wlm munge)",
    ),
]


def _pid_alive(pid_file: Path) -> bool:
    try:
        os.kill(int(pid_file.read_text()), 0)
    except (OSError, ValueError):
        return False
    return True


@pytest.fixture(scope="module")
def slurm_env():
    """Environment whose Slurm commands talk to the local cluster."""
    state_dir = Path(os.environ.get("RLCLI_SLURM_DIR", "/tmp/rlcli-slurm"))
    already_running = _pid_alive(state_dir / "run" / "slurmctld.pid")
    subprocess.run(["bash", str(START_SCRIPT), str(state_dir)], check=True, timeout=120)
    env = {**os.environ, "SLURM_CONF": str(state_dir / "slurm.conf"), "OMP_NUM_THREADS": "1"}
    try:
        yield env
    finally:
        if not already_running:
            subprocess.run(["bash", str(START_SCRIPT), "--stop", str(state_dir)], timeout=60)


def _wait_for_job(job_id: str, env: dict[str, str], timeout_s: float = 240) -> dict[str, str]:
    """Polls until the job ends; returns scontrol's fields (JobState, ExitCode, ...)."""
    deadline = time.monotonic() + timeout_s
    while True:
        shown = subprocess.run(
            ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, env=env
        )
        fields = dict(re.findall(r"(\w+)=(\S*)", shown.stdout))
        if fields.get("JobState") in TERMINAL_STATES:
            return fields
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job_id], env=env)
            pytest.fail(f"job {job_id} still {fields.get('JobState')} after {timeout_s} s")
        time.sleep(0.5)


def test_start_script_is_idempotent(slurm_env):
    state_dir = Path(slurm_env["SLURM_CONF"]).parent
    pid_before = (state_dir / "run" / "slurmctld.pid").read_text()
    subprocess.run(["bash", str(START_SCRIPT), str(state_dir)], check=True, timeout=120)
    assert (state_dir / "run" / "slurmctld.pid").read_text() == pid_before


def test_sbatch_script_runs_torchrun_ranks_that_all_reduce(slurm_env, tmp_path):
    job = SlurmJob(
        job_name="rlcli-allreduce",
        gpus_per_node=0,
        nproc_per_node=2,
        cpus_per_task=2,
        time="00:05:00",
        log_dir=tmp_path / "logs",
        workdir=tmp_path,
    )
    script = write_sbatch_script(
        render_sbatch_script(job, [str(ALLREDUCE_SCRIPT)]), tmp_path / "allreduce.sbatch"
    )
    job_id = submit_sbatch(script, env=slurm_env)
    fields = _wait_for_job(job_id, slurm_env)
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", fields
    log = (tmp_path / "logs" / f"rlcli-allreduce-{job_id}.out").read_text()
    assert f"job {job_id}: 1 node(s) x 2 process(es)" in log
    ranks = sorted(re.findall(r"allreduce rank=(\d) world=(\d) sum=(\S+) local_rank=(\d)", log))
    assert ranks == [("0", "2", "3", "0"), ("1", "2", "3", "1")]


def test_cli_refuses_an_unknown_key_before_submitting(slurm_env, tmp_path, monkeypatch):
    """`rlcli launch slurm` checks the recipe first: a typo costs no queue wait and no job."""
    monkeypatch.setenv("SLURM_CONF", slurm_env["SLURM_CONF"])
    recipe = tmp_path / "typo.yaml"
    recipe.write_text("nonsense_section:\n  value: 1\n")
    arguments = ["slurm", str(recipe), "--gpus-per-node", "0", "--nproc-per-node", "2"]
    arguments += ["--log-dir", str(tmp_path / "logs")]
    result = CliRunner().invoke(launch_app, arguments)
    assert result.exit_code != 0
    assert "unknown config key 'nonsense_section.value'" in str(result.exception)
    assert not (tmp_path / "logs").exists()  # no script written, nothing submitted


def test_cli_submitted_train_job_reports_a_rank_error_as_a_failed_job(
    slurm_env, tmp_path, monkeypatch
):
    """The real `rlcli launch slurm` path: sbatch -> srun -> torchrun -> python -m rlcli.cli train.

    The recipe is well formed, so the launch submits it, but its model folder does not exist on
    the node: every rank stops with the CLI's error message, and Slurm must see the job fail
    (not complete).
    """
    for key in ("SLURM_CONF", "OMP_NUM_THREADS"):
        monkeypatch.setenv(key, slurm_env[key])
    monkeypatch.chdir(tmp_path)
    recipe = tmp_path / "broken.yaml"
    missing_model = tmp_path / "no-such-model"
    recipe.write_text(f"data:\n  synthetic: arith\nmodel:\n  path: {missing_model}\n")
    arguments = ["slurm", str(recipe), "--gpus-per-node", "0", "--nproc-per-node", "2"]
    arguments += ["--time", "00:05:00", "--log-dir", str(tmp_path / "logs")]
    result = CliRunner().invoke(launch_app, arguments)
    assert result.exit_code == 0, result.output
    job_id = re.search(r"submitted job (\d+)", result.output).group(1)
    fields = _wait_for_job(job_id, slurm_env)
    log = (tmp_path / "logs" / f"rlcli-broken-{job_id}.out").read_text()  # exists: job started
    assert fields["JobState"] == "FAILED" and fields["ExitCode"] != "0:0", log
    assert f"model.path={missing_model}" in log
