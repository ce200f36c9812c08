"""How ``make test`` spreads the suite over two pytest-xdist workers (``-n 2 --dist loadgroup``).

Each test module is one group, so a module's shared fixtures (a built model, a started engine) are
made once, on one worker. The modules that look for leftover sandbox processes machine-wide, and
those that start sandboxed tool calls, share one group: run side by side, one module's live
sandbox would read as another's leftover.
"""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).parent
SANDBOX_GROUP = "sandbox"
SANDBOX_USERS = (TESTS / "rlcli" / "tools", TESTS / "docs")  # docs/agentic.md calls `python`


def _group_of(path: Path) -> str:
    if any(path.is_relative_to(folder) for folder in SANDBOX_USERS):
        return SANDBOX_GROUP
    return str(path.relative_to(TESTS))


@pytest.hookimpl(tryfirst=True)  # before xdist reads the marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(_group_of(Path(item.path))))
