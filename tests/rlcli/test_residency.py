"""The residency plan on a real PPO step: at each phase every model holds on the device what the
plan says (checked against the table written out by hand below), the bytes moved are counted on
every path (the step's ``offload/bytes_gb`` and ``onload/bytes_gb`` equal what the models
reported moving), and a skipped update moves no gradient or optimizer state; phase names are a
closed set (a typo is an error, in a plan row, at a call, and in the step's source)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlcli.model.residency import Phase, Residency, StepPhases
from tests.rlcli.test_train_e2e import REPO, TINY

WORKER = Path(__file__).with_name("residency_worker.py")
ALL = ["grads", "optimizer", "params"]
PARAMS = ["params"]

# With every model offloading everything it can (actor.offload_*, critic.offload_*, ref.offload),
# the state after entering each phase of a step that follows another step, by hand from the plan:
# the rollout sends everything to the host; each phase brings back what it computes with and the
# update hands the critic's memory to the actor.
AFTER_A_FULL_STEP = [
    ("rollout", {"actor": [], "critic": [], "reference": []}),
    ("distribute", {"actor": [], "critic": [], "reference": []}),
    ("old_log_prob", {"actor": PARAMS, "critic": [], "reference": []}),
    ("ref", {"actor": PARAMS, "critic": [], "reference": PARAMS}),
    ("values", {"actor": PARAMS, "critic": PARAMS, "reference": []}),
    ("adv", {"actor": PARAMS, "critic": PARAMS, "reference": []}),
    ("update_critic", {"actor": PARAMS, "critic": ALL, "reference": []}),
    ("update", {"actor": ALL, "critic": [], "reference": []}),
    ("sync", {"actor": ALL, "critic": [], "reference": []}),
]


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("residency")
    out = tmp / "steps.json"
    overrides = [*TINY, "rollout.engine=hf", f"trainer.output_dir={tmp / 'run'}"]
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(REPO)}
    recipe = str(REPO / "recipes" / "quickstart.yaml")
    proc = subprocess.run(
        [sys.executable, str(WORKER), recipe, str(out), *overrides],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    return json.loads(out.read_text())


def resident(step: dict) -> list[tuple[str, dict]]:
    return [(p["phase"], {k: v for k, v in p.items() if k != "phase"}) for p in step["phases"]]


def test_every_model_is_where_the_plan_says_at_each_phase(steps):
    assert resident(steps["2"]) == AFTER_A_FULL_STEP


def test_bytes_moved_are_counted_on_every_path(steps):
    for name, step in steps.items():
        metrics = step["metrics"]
        assert "timing/step" in metrics and "perf/tokens_per_s" in metrics, name
        for direction in ("offload", "onload"):
            moved = sum(m["bytes"] for m in step["moves"] if m["direction"] == direction)
            assert metrics[f"{direction}/bytes_gb"] == pytest.approx(moved / 1e9, rel=1e-12), name
    # The full step moved real bytes both ways (the optimizer state exists after step 1's
    # critic update; the actor's appears at its first update, in step 2).
    assert steps["2"]["metrics"]["onload/bytes_gb"] > 0
    assert steps["2"]["metrics"]["offload/bytes_gb"] > 0


def test_a_skipped_update_moves_no_optimizer_state(steps):
    warmup = steps["1"]  # trainer.critic_warmup=1: only the critic learns
    assert warmup["metrics"]["actor/skipped_update"] == 1.0
    assert "update" not in [p["phase"] for p in warmup["phases"]]
    actor_onloads = [
        m for m in warmup["moves"] if m["model"] == "actor" and m["direction"] == "onload"
    ]
    assert actor_onloads and all(m["kinds"] == PARAMS for m in actor_onloads), actor_onloads

    dapo = steps["dapo_skip"]  # every reward equal: DAPO keeps no group
    assert dapo["metrics"]["actor/skipped_update"] == 1.0
    assert [p["phase"] for p in dapo["phases"]] == ["rollout", "distribute"]
    assert all(m["direction"] == "offload" for m in dapo["moves"]), dapo["moves"]


def test_a_phase_name_that_is_not_a_phase_is_an_error():
    with pytest.raises(ValueError, match="unknown step phase 'updte'; the phases are: rollout"):
        Residency({"updte": {}}, {})
    residency = Residency({}, {})
    assert residency.plan.keys() == set(Phase)  # a phase without a row moves nothing
    with pytest.raises(ValueError, match="unknown step phase 'updte'"):
        residency.enter("updte")
    phases = StepPhases(residency)
    with pytest.raises(ValueError, match="unknown step phase 'updte'"), phases("updte"):
        pass
    with phases("update"), phases(Phase.sync):
        pass
    assert {"timing/update", "timing/sync"} <= phases.metrics().keys()


def test_every_phase_the_code_enters_by_name_is_a_phase():
    """``phases("...")`` and ``residency.enter("...")`` with a literal name anywhere in rlcli/:
    a typo there fails here, not at the step that first enters it."""
    entered = set()
    for path in (REPO / "rlcli").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not (isinstance(node, ast.Call) and node.args):
                continue
            func, first = node.func, node.args[0]
            named = (isinstance(func, ast.Name) and func.id == "phases") or (
                isinstance(func, ast.Attribute) and func.attr == "enter"
            )
            if named and isinstance(first, ast.Constant) and isinstance(first.value, str):
                entered.add((path.name, first.value))
    assert {name for _, name in entered} >= {"rollout", "update", "checkpoint"}, entered
    assert not {(f, name) for f, name in entered if name not in set(Phase)}
