"""Run the benchmark: every section in a fresh child process, then JSON + Markdown + PNG.

    run_benchmark(smoke=False, output_dir=RESULTS_DIR, sections=SECTIONS, log=print) -> Outputs

It first says which sections run and about how long they take (plan.py). Each section's process
ends with this one, however this one ends (lifetime.py).

The mode follows the hardware (GPU when CUDA is present, else CPU) unless `smoke` asks for the
tiny workload that only checks the code paths. A section that fails is recorded under
`errors` with the tail of its log; the others still run and the report is still written.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.hardware import detect_hardware, load_average
from benchmarks.lifetime import run_in_own_group
from benchmarks.plan import plan_lines
from benchmarks.report import write_report
from benchmarks.workload import Workload, workload_for

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
SECTIONS = (
    "device", "rollout", "sync", "train", "lora", "grpo", "placement", "mismatch", "recovery"
)  # fmt: skip
# What `make benchmark` runs (about 4 min on 2 CPU cores): the rollout engines, weight sync, LoRA
# and a GRPO step's phases. The train section's attention / packing comparisons, the placement
# runs and the mismatch runs (about 26 min more there) need `--full` (`make benchmark-full`).
QUICK_SECTIONS = ("device", "rollout", "sync", "lora", "grpo")
SECTION_TIMEOUT_S = {"smoke": 600, "cpu": 900, "gpu": 1800}
LOG_TAIL_LINES = 30


@dataclass
class Outputs:
    results: dict
    files: dict[str, Path]  # "json", "md", "png" (and "latest_md", "latest_png")


def choose_workload(smoke: bool) -> Workload:
    """Smoke when asked, else GPU when CUDA is present, else CPU."""
    if smoke:
        return workload_for("smoke")
    import torch

    if not torch.cuda.is_available():
        return workload_for("cpu")
    return workload_for("gpu", torch.cuda.get_device_properties(0).total_memory / 2**30)


def run_benchmark(
    *,
    smoke: bool = False,
    output_dir: Path = RESULTS_DIR,
    sections: Sequence[str] = SECTIONS,
    log: Callable[[str], None] = print,
) -> Outputs:
    """Run `sections` of this machine's workload; write `<date>-<host>[-smoke].{json,md,png}`
    into `output_dir` (and `latest.md` / `latest.png` when every section ran, not as a smoke
    run)."""
    unknown = [name for name in sections if name not in SECTIONS]
    if unknown:
        raise ValueError(f"unknown benchmark sections {unknown}; choose from {list(SECTIONS)}")
    workload = choose_workload(smoke)
    mode = workload.mode
    host = socket.gethostname().split(".")[0]
    date = datetime.date.today().isoformat()
    results: dict = {
        "schema_version": 1,
        "date": date,
        "host": host,
        "mode": mode,
        "load_average": {"start": load_average()},
        "workload": workload.to_dict(),
        "errors": {},
    }
    for line in plan_lines(mode, sections, SECTIONS, [Path(output_dir), RESULTS_DIR]):
        log(line)
    threads = None if mode == "gpu" else cpu_threads(results["load_average"]["start"][0])
    results["cpu_threads"] = threads
    # A smoke run only checks the code: one child for every section saves the start-ups.
    groups = [list(sections)] if smoke else [[name] for name in sections]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rlcli-benchmark-") as work:
        work_dir = Path(work)
        workload_file = work_dir / "workload.json"
        workload_file.write_text(json.dumps(workload.to_dict()))
        for group in groups:
            log(f"[benchmark] {', '.join(group)} ({mode}) ...")
            outcomes = _run_child(group, workload_file, work_dir, SECTION_TIMEOUT_S[mode], threads)
            for name in group:
                result, error = outcomes[name]
                if error is None:
                    results[name] = result
                    log(f"[benchmark] {name} done in {result['section_seconds']:.0f} s")
                else:
                    results["errors"][name] = error
                    log(f"[benchmark] {name} FAILED:\n{error}")
    results["wall_seconds"] = time.perf_counter() - start
    results["load_average"]["end"] = load_average()
    # The device section measures the matmul peak; without it the report still names the machine.
    results.setdefault("device", {"hardware": detect_hardware().to_dict()})
    add_derived_figures(results)
    stem = report_stem(date, host, smoke, sections)
    # latest.md / latest.png are the published table (docs/performance.md): only a full run
    # replaces them.
    whole = not smoke and set(sections) == set(SECTIONS)
    files = write_report(results, Path(output_dir), stem, update_latest=whole)
    return Outputs(results=results, files=files)


def report_stem(date: str, host: str, smoke: bool, sections: Sequence[str]) -> str:
    """`<date>-<host>`, then `-smoke` for a smoke run, `-quick` for the quick set, or the sections
    of another partial run (so it never overwrites the day's full report)."""
    if smoke:
        return f"{date}-{host}-smoke"
    if set(sections) == set(SECTIONS):
        return f"{date}-{host}"
    if list(sections) == list(QUICK_SECTIONS):
        return f"{date}-{host}-quick"
    return f"{date}-{host}-" + "-".join(sections)


def cpu_threads(load_1m: float) -> int:
    """Threads for torch / OpenMP in CPU mode: OMP_NUM_THREADS when the user set it, else the
    cores the neighbours leave idle (at least one). On a shared machine, OpenMP threads that
    wait at every op's barrier for a core someone else holds are ruinous: HF `generate` of the
    25M model ran at 61 new tokens/s with 2 threads and 870 with 1 (2 cores, load average 4).
    Every engine and baseline of a run gets the same count, so the ratios stay fair."""
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return int(os.environ["OMP_NUM_THREADS"])
    return max(1, len(os.sched_getaffinity(0)) - round(load_1m))


def _run_child(
    names: list[str], workload_file: Path, work_dir: Path, timeout_s: int, threads: int | None
) -> dict[str, tuple[dict | None, str | None]]:
    """{name: (result, None) or (None, error text)} for the sections one child ran."""
    tag = "-".join(names)
    result_file = work_dir / f"{tag}.result.json"
    log_file = work_dir / f"{tag}.log"
    env = child_env(threads)
    command = [sys.executable, "-m", "benchmarks.sections", ",".join(names), str(workload_file),
               str(work_dir), str(result_file)]  # fmt: skip
    failure = run_in_own_group(
        command, cwd=work_dir, env=env, log_file=log_file, timeout_s=timeout_s
    )
    outcomes = json.loads(result_file.read_text()) if result_file.is_file() else {}
    finished: dict[str, tuple[dict | None, str | None]] = {}
    for name in names:
        outcome = outcomes.get(name)
        if outcome is None:
            finished[name] = None, f"{failure or 'no result'}\n{_tail(log_file)}"
        elif "error" in outcome:
            finished[name] = None, last_lines(outcome["error"])
        else:
            finished[name] = outcome["result"], None
    return finished


def child_env(threads: int | None) -> dict[str, str]:
    """The environment of a benchmark child: this checkout first on PYTHONPATH, warnings off,
    and OMP_NUM_THREADS=`threads` unless None."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
        "PYTHONWARNINGS": "ignore",
        "TOKENIZERS_PARALLELISM": "false",
    }
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def _tail(path: Path) -> str:
    return last_lines(path.read_text(encoding="utf-8", errors="replace"))


def last_lines(text: str) -> str:
    return "\n".join(text.splitlines()[-LOG_TAIL_LINES:])


def add_derived_figures(results: dict) -> None:
    """Ratios against the device: MFU (data-sheet peak, GPU only), the fraction of the measured
    matmul FLOP/s, and the compute ceiling of rollout tokens/s (2 FLOPs per matmul parameter
    per new token at the measured matmul rate; attention and sampling not counted)."""
    device = results.get("device", {})
    matmul = device.get("matmul_flops")
    peak = device.get("hardware", {}).get("peak_bf16_flops")
    train = results.get("train")
    if train:
        for key in ("megatron", "hf_baseline"):
            flops = train[key]["flops_per_s"]
            train[key]["mfu"] = flops / peak if peak else None
            train[key]["matmul_fraction"] = flops / matmul if matmul else None
    rollout = results.get("rollout")
    if rollout and matmul:
        rollout["compute_ceiling_tokens_per_s"] = matmul / (2 * rollout["matmul_params"])
