"""parallel.mesh: layout validation and a single-process (no torchrun) world."""

from __future__ import annotations

import subprocess
import sys

import pytest

from parallel.mesh import ParallelLayoutError, init_parallel
from tests.parallel.dist_utils import REPO_ROOT


def test_impossible_layout_names_sizes_and_keys(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "6")
    with pytest.raises(ParallelLayoutError) as error:
        init_parallel(tp=2, pp=2)
    assert "world size 6 is not divisible by tp*pp = 4 (parallel.tp=2, parallel.pp=2)" in str(
        error.value
    )
    assert isinstance(error.value, ValueError)


def test_virtual_pipeline_needs_pipeline(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ParallelLayoutError, match="parallel.vpp=2 needs parallel.pp >= 2"):
        init_parallel(tp=2, pp=1, vpp=2)


def test_expert_parallel_must_fit_the_data_parallel_ranks(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")  # tp2 x dp2
    with pytest.raises(ParallelLayoutError, match="parallel.ep must divide the data-parallel"):
        init_parallel(tp=2, ep=4)  # expert TP = tp = 2: 8 ranks per stage needed
    with pytest.raises(ParallelLayoutError, match="parallel.ep and parallel.expert_tp"):
        init_parallel(tp=2, ep=0)


SINGLE_PROCESS = """
import torch, torch.distributed as dist
from parallel.mesh import init_parallel, destroy_parallel
mesh = init_parallel(seed=77)
drawn = torch.rand(4)
torch.manual_seed(77)
assert torch.equal(drawn, torch.rand(4)), "CPU generator not seeded"
assert (mesh.world_size, mesh.dp, mesh.tp_rank, mesh.pp_rank) == (1, 1, 0, 0), mesh
assert mesh.is_first_stage and mesh.is_last_stage and mesh.last_stage_global_rank() == 0
value = torch.ones(2, device="cuda")  # redirected to cpu by parallel.cpu_compat
dist.all_reduce(value, group=mesh.dp_group)
assert value.device.type == "cpu" and value.type() == "torch.cuda.FloatTensor"
assert mesh.broadcast_object_from_last_stage("x") == "x"
# Suspended for the rollout engine (no megatron inside): plain torch semantics, then back on.
from parallel import cpu_compat
with cpu_compat.suspended():
    assert torch.ones(1).type() == "torch.FloatTensor"
    with cpu_compat.suspended():  # nested: the mode is no longer the innermost; nothing to do
        assert torch.ones(1).type() == "torch.FloatTensor"
assert torch.ones(1).type() == "torch.cuda.FloatTensor"
destroy_parallel()
assert not dist.is_initialized()
print("ok")
"""


def test_single_process_world_without_torchrun():
    # A subprocess: enabling cpu_compat installs a process-wide torch function mode.
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, "-c", SINGLE_PROCESS],
        cwd=REPO_ROOT,
        env={**env, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
