"""The benchmark's sync section: benchmarks/sync_bench.py run once per model size in its own
process (single process, then TP2 and PP2 under torchrun where two cores or GPUs exist), its
timings renamed for the report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from benchmarks.memory import GIB
from benchmarks.workload import ModelShape, Workload

REPO_ROOT = Path(__file__).resolve().parents[1]

# benchmarks/sync_bench.py's method names -> this report's.
SYNC_METHODS = {
    "bucketed sync": "reshard",
    "naive sync": "naive",
    "memcpy": "memcpy",
    "buckets (no engine)": "reshard_without_engine",
    "engine reload": "engine_reload",
}


def sync_section(workload: Workload, work_dir: Path) -> dict:
    """benchmarks/sync_bench.py once per model size, each in its own process: it builds the
    random model, the Megatron model and the vLLM engine, and times the methods (best of
    `sync_repeats`). Then the first size from 2-process training layouts (TP2, PP2) under
    torchrun, where 2 cores / GPUs exist. Peak memory: the process's RSS high-water mark."""
    rows = [_run_sync_bench(shape, workload, work_dir) for shape in workload.sync_models]
    devices = (
        torch.cuda.device_count() if torch.cuda.is_available() else len(os.sched_getaffinity(0))
    )
    layouts = workload.sync_layouts if devices >= 2 else []
    rows += [
        _run_sync_bench(workload.sync_models[0], workload, work_dir, layout) for layout in layouts
    ]
    return {"bucket_mb": workload.sync_bucket_mb, "engine": "vllm", "sizes": rows}


def _run_sync_bench(
    shape: ModelShape, workload: Workload, work_dir: Path, layout: str | None = None
) -> dict:
    if shape.tie_word_embeddings:
        raise ValueError(f"sync_bench.py builds untied models; {shape.name} is tied")
    label = shape.name if layout is None else f"{shape.name} {layout.upper()}2 (2 ranks)"
    json_file = work_dir / f"sync-{shape.name}-{layout or 'single'}.json"
    launcher = [sys.executable]
    if layout is not None:  # each rank one thread: 2 ranks share the cores the run was given
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    command = [
        *launcher, str(REPO_ROOT / "benchmarks" / "sync_bench.py"),
        "--engine", "vllm", "--bucket-mb", str(workload.sync_bucket_mb),
        "--hidden", str(shape.hidden_size), "--layers", str(shape.num_layers),
        "--heads", str(shape.num_heads), "--kv-heads", str(shape.num_kv_heads),
        "--ffn", str(shape.intermediate_size), "--vocab", str(shape.vocab_size),
        "--repeats", str(workload.sync_repeats), "--json", str(json_file),
        *([f"--{layout}", "2"] if layout else []),
    ]  # fmt: skip
    env = dict(os.environ)
    if layout is not None and not torch.cuda.is_available():
        env["OMP_NUM_THREADS"] = "1"
    child = subprocess.Popen(command, cwd=work_dir, env=env)
    _, status, usage = os.wait4(child.pid, 0)  # reaps it, with its own resource usage
    child.returncode = os.waitstatus_to_exitcode(status)  # so Popen never waits again
    if child.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited with {child.returncode}")
    bench = json.loads(json_file.read_text())
    row = {"model": label, "params": bench["model_params"], "bytes": bench["bytes"],
           "num_buckets": bench["num_buckets"], "layout": bench.get("layout"),
           "processes": 1 if layout is None else 2}  # fmt: skip
    for method in bench["rows"]:
        name = SYNC_METHODS.get(method["method"], method["method"])
        row[name] = {"seconds": method["seconds"], "gbps": method["gbps"]}
    # wait4's figure is the largest single process of the launch (a rank, under torchrun).
    row["memory"] = {"start_gb": 0.0, "peak_gb": usage.ru_maxrss * 1024 / GIB,
                     "source": "rss_hwm of its own process"}  # fmt: skip
    return row
