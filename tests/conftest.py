"""How ``make test`` spreads the suite over two pytest-xdist workers (``-n 2 --dist loadgroup``).

Each test module is one group, so a module's shared fixtures (a built model, a started engine) are
made once, on one worker. The modules that look for leftover sandbox processes machine-wide, and
those that start sandboxed tool calls, share one group: run side by side, one module's live
sandbox would read as another's leftover.

xdist hands the groups out in the order of the collected tests, the next one to whichever worker
runs short. The longest groups come first (``LONGEST``, longest first: the longest-processing-time
rule), so that no long group starts near the end while the other worker has nothing left to do;
the many short groups that follow fill the gaps. Within a group the tests keep their order.

``make test-mcore19`` runs the suite again under the GPU extra's pins (Python 3.12, megatron-core
0.19.2, PyPI's CUDA torch; transformers in the same range). The tests under ``PIN_FREE`` check
nothing those pins change, so they are marked ``pin_free`` and run in ``make test`` only: the
docs' command blocks (the paths they run are the end-to-end tests'), the sandbox and tool tests,
the sbatch jobs and the benchmark harness.

``make test-fast`` is the developer's loop: it leaves out the modules under ``SLOW`` (marked
``slow``: each takes 40 s or more of test time, the training runs, engines and CLI processes
they start), the torchrun tests (``dist``) and the Slurm jobs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).parent
SANDBOX_GROUP = "sandbox"
SANDBOX_USERS = (TESTS / "rlcli" / "tools", TESTS / "docs")  # docs/agentic.md calls `python`

# The groups that take longest, longest first, from the --durations of `make test` on a 2-core
# Intel Xeon (2026-12-06: 80 min of test time over the two workers; update the order when one of
# them changes much).
LONGEST = (
    SANDBOX_GROUP,  # the docs' command blocks and the tool / sandbox tests: 11 1/2 min
    "rlcli/test_separate_placement.py",  # 5 1/2 min
    "rlcli/test_train_e2e.py",
    "rlcli/test_run_survival.py",
    "benchmarks/test_benchmark_smoke.py",  # one test of 4 min
    "rlcli/test_lora_train.py",
    "rlcli/test_train_errors.py",
    "parallel/test_reshard.py",
    "gpu/test_gpu_path_on_cpu.py",
    "rlcli/test_ppo.py",
    "rlcli/test_run_restarts.py",
    "rlcli/test_agents_e2e.py",
    "rlcli/test_cli_errors.py",
    "rlcli/test_train_moe.py",
    "rlcli/test_sft_checkpoints.py",
    "rlcli/test_checkpoint_resume_e2e.py",
    "parallel/test_convert_cli.py",
    "rlcli/test_reward_model_training.py",
    "parallel/test_convert_parity.py",
)


# Modules of 40 s or more of test time in `make test` (2026-12-06 durations).
SLOW = tuple(
    TESTS / name
    for name in (
        "benchmarks/test_benchmark_smoke.py",
        "docs/test_docs_commands.py",
        "gpu/test_gpu_path_on_cpu.py",
        "parallel/test_checkpoint.py",
        "parallel/test_convert_cli.py",
        "parallel/test_convert_parity.py",
        "parallel/test_lora.py",
        "parallel/test_offload.py",
        "parallel/test_reshard.py",
        "parallel/test_vision_language.py",
        "rlcli/test_agent_loop.py",
        "rlcli/test_agents.py",
        "rlcli/test_agents_e2e.py",
        "rlcli/test_algorithms_e2e.py",
        "rlcli/test_checkpoint_resume_e2e.py",
        "rlcli/test_cli_errors.py",
        "rlcli/test_config.py",
        "rlcli/test_distill.py",
        "rlcli/test_dp_step.py",
        "rlcli/test_eval.py",
        "rlcli/test_lora_settings.py",
        "rlcli/test_lora_train.py",
        "rlcli/test_model_rewards.py",
        "rlcli/test_multi_turn_e2e.py",
        "rlcli/test_ppo.py",
        "rlcli/test_repeatable.py",
        "rlcli/test_reward_model_training.py",
        "rlcli/test_run_restarts.py",
        "rlcli/test_run_survival.py",
        "rlcli/test_separate_placement.py",
        "rlcli/test_separate_sync.py",
        "rlcli/test_sft_checkpoints.py",
        "rlcli/test_token_budget.py",
        "rlcli/test_train_e2e.py",
        "rlcli/test_train_errors.py",
        "rlcli/test_train_hybrid.py",
        "rlcli/test_train_moe.py",
        "rlcli/test_vision_language_rl.py",
    )
)


PIN_FREE = (
    TESTS / "docs",
    TESTS / "rlcli" / "tools",
    TESTS / "slurm",
    TESTS / "benchmarks",
)


def _group_of(path: Path) -> str:
    if any(path.is_relative_to(folder) for folder in SANDBOX_USERS):
        return SANDBOX_GROUP
    return str(path.relative_to(TESTS))


def _rank(group: str) -> int:
    return LONGEST.index(group) if group in LONGEST else len(LONGEST)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    groups = {}
    for item in items:
        if any(Path(item.path).is_relative_to(place) for place in PIN_FREE):
            item.add_marker(pytest.mark.pin_free)
        if Path(item.path) in SLOW:
            item.add_marker(pytest.mark.slow)
        marker = item.get_closest_marker("xdist_group")
        if marker is None:
            groups[item] = _group_of(Path(item.path))
            item.add_marker(pytest.mark.xdist_group(groups[item]))
        else:
            groups[item] = marker.args[0] if marker.args else marker.kwargs.get("name", "")
    items.sort(key=lambda item: _rank(groups[item]))  # stable: each group keeps its order
