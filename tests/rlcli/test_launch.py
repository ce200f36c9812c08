import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlcli.commands.launch import launch_app
from rlcli.errors import UserError
from rlcli.run.launch import (
    SlurmJob,
    local_torchrun_command,
    render_sbatch_script,
    train_program_args,
    validate_overrides,
)

ALLREDUCE_SCRIPT = Path(__file__).resolve().parents[1] / "slurm" / "allreduce_check.py"


def _sbatch_directives(script: str) -> dict[str, str]:
    pairs = (
        line[len("#SBATCH ") :].partition("=")
        for line in script.splitlines()
        if line.startswith("#SBATCH ")
    )
    return {key: value for key, _, value in pairs}


def _srun_argv(script: str) -> list[str]:
    """The srun command line as bash would split it (continuation lines joined)."""
    joined = script.replace("\\\n", " ")
    line = next(line for line in joined.splitlines() if line.startswith("srun "))
    argv = shlex.split(line)
    return argv[:-1] if argv[-1] == "&" else argv  # run in the background, then waited for


def _bash_syntax_ok(script: str, tmp_path: Path) -> None:
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    subprocess.run(["bash", "-n", str(path)], check=True)


# What a recipe needs to pass `config validate` (the model folder lives on the cluster: not looked up).
MINIMAL_RECIPE = "model:\n  path: /cluster/models/qwen\ntrainer:\n  total_steps: 2\n"


def _recipe(tmp_path: Path) -> Path:
    recipe = tmp_path / "grpo tiny.yaml"  # a space, to prove the quoting
    recipe.write_text(MINIMAL_RECIPE)
    return recipe


def test_train_script_runs_torchrun_with_rendezvous_on_every_node(tmp_path):
    recipe = _recipe(tmp_path)
    job = SlurmJob(
        job_name="grpo",
        nodes=4,
        gpus_per_node=8,
        time="1-12:00:00",
        partition="gpu",
        account="proj",
        log_dir=tmp_path / "logs",
        workdir=tmp_path,
        sbatch_options=("--qos=high",),
    )
    overrides = ["actor.lr=1e-5", "data.prompt_template=Q: {q} A:"]
    script = render_sbatch_script(job, train_program_args(recipe, overrides))
    _bash_syntax_ok(script, tmp_path)
    assert _sbatch_directives(script) == {
        "--job-name": "grpo",
        "--nodes": "4",
        "--ntasks-per-node": "1",
        "--gpus-per-node": "8",
        "--partition": "gpu",
        "--account": "proj",
        "--time": "1-12:00:00",
        "--output": f"{tmp_path}/logs/%x-%j.out",
        "--requeue": "",
        "--signal": "B:USR1@120",
        "--qos": "high",
    }
    assert _srun_argv(script) == [
        "srun",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "$SLURM_NNODES",
        "--nproc_per_node",
        "8",
        "--max-restarts",
        "3",
        "--rdzv_backend",
        "c10d",
        "--rdzv_endpoint",
        "$MASTER_ADDR:$MASTER_PORT",
        "--rdzv_id",
        "$SLURM_JOB_ID",
        "-m",
        "rlcli.cli",
        "train",
        str(recipe),
        "actor.lr=1e-5",
        "data.prompt_template=Q: {q} A:",
    ]
    assert 'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)' in script


def test_script_sets_network_interface_nccl_env_and_requeues_on_usr1(tmp_path):
    job = SlurmJob(job_name="g", nodes=2, network_interface="ib0", max_restarts=5)
    script = render_sbatch_script(job, ["x.py"])
    _bash_syntax_ok(script, tmp_path)
    assert "IFACE=ib0" in script
    assert 'export NCCL_SOCKET_IFNAME="$IFACE" GLOO_SOCKET_IFNAME="$IFACE"' in script
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1" in script
    assert "trap requeue USR1" in script and 'scontrol requeue "$SLURM_JOB_ID"' in script
    argv = _srun_argv(script)
    assert argv[argv.index("--max-restarts") + 1] == "5"
    detected = render_sbatch_script(SlurmJob(job_name="g"), ["x.py"])
    assert "IFACE=${NCCL_SOCKET_IFNAME:-}" in detected and "ip -o route show default" in detected
    plain = render_sbatch_script(SlurmJob(job_name="g", requeue=False), ["x.py"])
    assert "#SBATCH --requeue" not in plain and "trap requeue" not in plain
    with pytest.raises(UserError, match="--network-interface"):
        render_sbatch_script(SlurmJob(job_name="g", network_interface="eth0; rm"), ["x.py"])


def test_interface_detection_and_requeue_trap_run_in_bash(tmp_path):
    """The rendered preamble runs: the detected interface exported to NCCL and gloo, and the
    wait loop survives a USR1 (fake srun / scontrol / ip on PATH)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fakes = {
        "scontrol": 'if [ "$1" = requeue ]; then echo "REQUEUED $2"; else echo node1; fi',
        "getent": "echo 10.0.0.5 STREAM node1",
        "ip": 'case "$*" in *"dev eth7"*) echo "2: eth7 inet 10.0.0.5/24 brd x";; '
        '*route*) echo "default via 10.0.0.1 dev eth9";; '
        '*) echo "1: lo inet 127.0.0.1/8 scope host lo"; echo "2: eth7 inet 10.0.0.5/24 x";; esac',
        "srun": 'echo "NCCL=$NCCL_SOCKET_IFNAME GLOO=$GLOO_SOCKET_IFNAME ADDR=$MASTER_ADDR"; '
        'kill -USR1 $PPID; sleep 1; [ -f "$RLCLI_STOP_FILE" ] && echo STOP_FILE_SEEN; '
        "echo SRUN_DONE",
    }
    for name, body in fakes.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    logs = tmp_path / "logs"
    logs.mkdir()
    script = render_sbatch_script(SlurmJob(job_name="g", nodes=2, log_dir=logs), ["x.py"])
    path = tmp_path / "job.sh"
    path.write_text(script)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "77",
        "SLURM_JOB_NODELIST": "node1",
        "SLURM_NNODES": "2",
    }
    env.pop("NCCL_SOCKET_IFNAME", None)
    out = subprocess.run(["bash", str(path)], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "NCCL=eth7 GLOO=eth7 ADDR=node1" in out.stdout
    assert "REQUEUED 77" in out.stdout and "SRUN_DONE" in out.stdout
    # USR1 created the trainer's stop file (it checkpoints and exits 0), requeued only after
    # srun ended, and the file is gone so the requeued job (same id) does not stop at once.
    assert "STOP_FILE_SEEN" in out.stdout
    assert out.stdout.index("SRUN_DONE") < out.stdout.index("REQUEUED 77")
    assert not (logs / "stop-77").exists()


def test_cpu_job_has_no_gpu_request_and_passes_cpus_to_srun(tmp_path):
    job = SlurmJob(job_name="cpu", gpus_per_node=0, nproc_per_node=2, cpus_per_task=2)
    script = render_sbatch_script(job, [str(ALLREDUCE_SCRIPT)])
    _bash_syntax_ok(script, tmp_path)
    directives = _sbatch_directives(script)
    assert "--gpus-per-node" not in directives and "--time" not in directives
    assert directives["--cpus-per-task"] == "2"
    argv = _srun_argv(script)
    assert "--cpus-per-task=2" in argv and argv[argv.index("--nproc_per_node") + 1] == "2"


@pytest.mark.parametrize(
    ("job", "message"),
    [
        (SlurmJob(job_name="x", nodes=0), "--nodes must be at least 1"),
        (SlurmJob(job_name="x", time="4h"), "--time '4h'.*HH:MM:SS"),
        (SlurmJob(job_name="x", time="01:61:00"), "--time"),
        (SlurmJob(job_name="x", gpus_per_node=0), "--nproc-per-node"),
        (SlurmJob(job_name="x", partition="gpu\n#SBATCH --x"), "--partition"),
        (SlurmJob(job_name="two words"), "--job-name"),
        (SlurmJob(job_name="x", sbatch_options=("qos=high",)), "--sbatch-option"),
    ],
)
def test_invalid_jobs_name_the_option(job, message):
    with pytest.raises(UserError, match=message):
        render_sbatch_script(job, ["x.py"])


def test_overrides_must_be_key_value():
    assert validate_overrides(["a.b=1", "c="]) == ["a.b=1", "c="]
    with pytest.raises(UserError, match="'actor.lr' is not key=value"):
        validate_overrides(["actor.lr"])


def test_cli_dry_run_prints_the_script_with_options_after_overrides(tmp_path):
    recipe = _recipe(tmp_path)
    output = tmp_path / "out" / "job.sbatch"
    arguments = ["slurm", str(recipe), "actor.lr=2e-6", "--nodes", "2", "--gpus-per-node", "4"]
    arguments += ["--time", "00:30:00", "--partition", "p", "--dry-run", "--output", str(output)]
    result = CliRunner().invoke(launch_app, arguments)
    assert result.exit_code == 0, result.output
    assert result.output == output.read_text()
    _bash_syntax_ok(result.output, tmp_path)
    assert _sbatch_directives(result.output)["--job-name"] == "rlcli-grpo_tiny"
    argv = _srun_argv(result.output)
    assert argv[-3:] == ["train", str(recipe), "actor.lr=2e-6"]
    assert argv[argv.index("--nproc_per_node") + 1] == "4"


def test_cli_rejects_bad_time_and_missing_recipe(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(MINIMAL_RECIPE)
    result = CliRunner().invoke(launch_app, ["slurm", str(recipe), "--time", "90", "--dry-run"])
    assert isinstance(result.exception, UserError) and "--time" in str(result.exception)
    result = CliRunner().invoke(launch_app, ["local", str(tmp_path / "nope.yaml"), "--nproc", "2"])
    assert isinstance(result.exception, UserError) and "nope.yaml not found" in str(
        result.exception
    )


def test_cli_submit_without_sbatch_says_so(tmp_path, monkeypatch):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(MINIMAL_RECIPE)
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    arguments = ["slurm", str(recipe), "--log-dir", str(tmp_path / "logs")]
    result = CliRunner().invoke(launch_app, arguments)
    assert isinstance(result.exception, UserError)
    assert "sbatch is not on PATH" in str(result.exception)
    assert (tmp_path / "logs" / "rlcli-r.sbatch").is_file()  # written before submitting


def test_cli_local_dry_run_prints_the_torchrun_command(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(MINIMAL_RECIPE)
    result = CliRunner().invoke(
        launch_app, ["local", str(recipe), "actor.lr=1e-6", "--nproc", "2", "--dry-run"]
    )
    assert result.exit_code == 0, result.output
    assert shlex.split(result.output) == [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "--max-restarts",
        "0",
        "-m",
        "rlcli.cli",
        "train",
        str(recipe),
        "actor.lr=1e-6",
    ]


@pytest.mark.dist
def test_local_torchrun_command_starts_ranks_that_all_reduce():
    command = local_torchrun_command(2, [str(ALLREDUCE_SCRIPT)])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    completed = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert completed.returncode == 0, completed.stderr
    lines = sorted(re.findall(r"allreduce rank=\d world=\d sum=\S+", completed.stdout))
    assert lines == ["allreduce rank=0 world=2 sum=3", "allreduce rank=1 world=2 sum=3"]


def test_separate_placement_lays_out_trainer_and_rollout_ranks(tmp_path):
    recipe = _recipe(tmp_path)
    separate = ["rollout.placement=separate", "rollout.num_ranks=4", "rollout.tp=2"]
    arguments = ["slurm", str(recipe), *separate, "--nodes", "2", "--gpus-per-node", "8"]
    result = CliRunner().invoke(launch_app, [*arguments, "--dry-run"])
    assert result.exit_code == 0, result.output
    _bash_syntax_ok(result.output, tmp_path)
    assert "ranks 0-11 train, ranks 12-15 run 2 engine(s) of rollout.tp=2" in result.output
    assert _srun_argv(result.output)[-3:] == separate  # the ranks read their roles from these
    colocated = CliRunner().invoke(launch_app, ["slurm", str(recipe), "--dry-run"])
    assert "every rank trains and runs a colocated engine" in colocated.output
    # 12 ranks on nodes of 6, the last 8 rolling out at rollout.tp=4: the engine of ranks 4-7
    # would sit on both nodes.
    spanning = ["rollout.placement=separate", "rollout.num_ranks=8", "rollout.tp=4"]
    result = CliRunner().invoke(
        launch_app, ["slurm", str(recipe), *spanning, "--nodes", "2", "--gpus-per-node", "6"]
    )
    assert isinstance(result.exception, UserError), result.output
    assert "rollout.tp=4 would span two nodes" in str(result.exception)
    everything = ["rollout.placement=separate", "rollout.num_ranks=16"]
    result = CliRunner().invoke(
        launch_app, ["slurm", str(recipe), *everything, "--nodes", "2", "--dry-run"]
    )
    assert isinstance(result.exception, UserError)
    assert "rollout.num_ranks=16 makes every one of the 16 processes a rollout rank" in str(
        result.exception
    )


def test_launch_checks_the_recipe_and_layout_before_writing_or_submitting(tmp_path):
    """A typo or a layout the job cannot hold fails at once (exit 2, naming the key), with no
    script written; `rlcli config validate --world-size` gives the same verdicts."""
    recipe = _recipe(tmp_path)
    output = tmp_path / "job.sbatch"
    typo = CliRunner().invoke(
        launch_app, ["slurm", str(recipe), "actor.lrr=1", "--dry-run", "--output", str(output)]
    )
    assert isinstance(typo.exception, UserError) and "actor.lrr" in str(typo.exception)
    assert not output.exists()
    layout = CliRunner().invoke(
        launch_app, ["slurm", str(recipe), "parallel.tp=4", "--gpus-per-node", "3", "--dry-run"]
    )
    assert isinstance(layout.exception, UserError) and "parallel.tp" in str(layout.exception)
    local = CliRunner().invoke(
        launch_app, ["local", str(recipe), "parallel.tp=4", "--nproc", "2", "--dry-run"]
    )
    assert isinstance(local.exception, UserError) and "parallel.tp" in str(local.exception)


def test_cli_network_interface_sets_the_job_socket_variables(tmp_path):
    recipe = _recipe(tmp_path)
    result = CliRunner().invoke(
        launch_app, ["slurm", str(recipe), "--network-interface", "ib0", "--dry-run"]
    )
    assert result.exit_code == 0, result.output
    assert "ib0" in result.output and "NCCL_SOCKET_IFNAME" in result.output
    _bash_syntax_ok(result.output, tmp_path)
