"""A stopped benchmark leaves no process behind (benchmarks/lifetime.py), and says before it starts
which sections run and about how long they take (benchmarks/plan.py).

The processes are stand-ins that import no torch, so each case takes seconds: a "make" that starts
the top process and waits; the top process, which runs a section process the way run.py does
(``run_in_own_group``); the section process, which ties itself to its parent the way
``python -m benchmarks.sections`` does and starts a long-lived child in its group, as the
placement section starts ``rlcli train`` runs. Every process carries a tag in its environment.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from benchmarks.plan import ROUGH_CPU_SECONDS, plan_lines
from benchmarks.run import QUICK_SECTIONS, SECTIONS

REPO = Path(__file__).resolve().parents[2]
TAG = "RLCLI_TEST_BENCH_TAG"

SECTION = """
import subprocess, sys, time
from benchmarks.lifetime import take_group_down_with_parent
take_group_down_with_parent()
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
time.sleep(600)
"""
TOP = """
import os, signal, sys
from pathlib import Path
from benchmarks.lifetime import end_with_parent, exit_on_sigterm, run_in_own_group
signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started with SIGINT ignored
end_with_parent() if sys.argv[2] == "tied" else exit_on_sigterm()
run_in_own_group([sys.executable, "-c", sys.argv[3]], cwd=Path.cwd(), env=dict(os.environ),
                 log_file=Path(sys.argv[1]), timeout_s=600)
"""
MAKE = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", *sys.argv[1:]])
time.sleep(600)
"""


def tagged(tag: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter():
        try:
            if process.status() != psutil.STATUS_ZOMBIE and process.environ().get(TAG) == tag:
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def wait_for(condition, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


@pytest.mark.parametrize(
    ("victim", "number"),
    [
        ("top", signal.SIGTERM),  # timeout, kill, a scheduler
        ("top", signal.SIGINT),  # Ctrl-C
        ("top", signal.SIGKILL),  # nothing of the top process runs: the section ends itself
        ("make", signal.SIGKILL),  # make killed: the top process (tied to it) and its section go
    ],
)
def test_a_stopped_benchmark_leaves_no_process(tmp_path, victim, number):
    tag = uuid.uuid4().hex
    env = {**os.environ, TAG: tag, "PYTHONPATH": str(REPO)}
    top_args = [TOP, str(tmp_path / "section.log"), "tied" if victim == "make" else "", SECTION]
    if victim == "make":
        started = subprocess.Popen([sys.executable, "-c", MAKE, *top_args], cwd=tmp_path, env=env)
        expected = 4  # make, top, section, its child
    else:
        started = subprocess.Popen([sys.executable, "-c", *top_args], cwd=tmp_path, env=env)
        expected = 3
    try:
        assert wait_for(lambda: len(tagged(tag)) == expected), [p.cmdline() for p in tagged(tag)]
        started.send_signal(number)
        started.wait(timeout=30)
        assert wait_for(lambda: not tagged(tag), timeout=30), [p.cmdline() for p in tagged(tag)]
    finally:
        for process in tagged(tag):
            process.kill()


def test_the_plan_names_the_sections_and_the_time_of_the_last_recorded_run(tmp_path):
    record = {"schema_version": 1, "mode": "cpu", "date": "2026-12-04", "errors": {},
              "device": {"section_seconds": 3.2}, "rollout": {"section_seconds": 40.0},
              "sync": {"section_seconds": 100.0}, "lora": {"section_seconds": 20.0},
              "grpo": {"section_seconds": 30.0}, "train": {"section_seconds": 190.0}}  # fmt: skip
    (tmp_path / "2026-12-04-vm.json").write_text(json.dumps(record))
    older = {**record, "date": "2026-12-01", "placement": {"section_seconds": 600.0}}
    (tmp_path / "2026-12-01-vm.json").write_text(
        json.dumps({**older, "grpo": {"section_seconds": 9}})
    )

    lines = plan_lines("cpu", QUICK_SECTIONS, SECTIONS, [tmp_path])
    assert lines[0] == (
        "[benchmark] cpu mode, 5 sections: device ~3 s, rollout ~40 s, sync ~2 min, lora ~20 s, "
        "grpo ~30 s"  # the newest record wins
    )
    # 193 s of sections + 5 section processes started
    assert lines[1] == "[benchmark] about 3 min in all (the sections' times in 2026-12-04-vm.json)"
    assert lines[2].startswith(
        "[benchmark] left out: train ~3 min, placement ~10 min, mismatch ~12 min, recovery ~2 min ("
    )
    assert "make benchmark-full" in lines[2]


def test_without_a_record_the_plan_gives_rough_figures_or_says_it_has_none(tmp_path):
    lines = plan_lines("cpu", ["placement"], SECTIONS, [tmp_path])
    assert ROUGH_CPU_SECONDS["placement"] == 632
    assert lines[0] == "[benchmark] cpu mode, 1 section: placement ~11 min"
    assert "rough" in lines[1]
    lines = plan_lines("gpu", SECTIONS, SECTIONS, [tmp_path])
    assert lines[0].startswith("[benchmark] gpu mode, 9 sections: device, rollout, sync")
    assert lines[1] == "[benchmark] no recorded gpu run to estimate the time from"
    assert len(lines) == 2  # nothing left out
