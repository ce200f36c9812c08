"""docs/config.md is generated from the config dataclasses; it must match a fresh generation."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

from rlcli.commands.docs import REGENERATE, render_config_reference
from rlcli.config.schema import RLConfig, valid_keys

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "docs" / "config.md"


def test_committed_config_reference_is_current():
    text, _ = render_config_reference()
    committed = REFERENCE.read_text() if REFERENCE.is_file() else ""
    assert committed == text, f"docs/config.md is stale: regenerate it with `{REGENERATE}`"


def test_every_key_appears_once_with_its_default():
    text, _ = render_config_reference()
    rows = {
        line.split("|")[1].strip().strip("`")
        for line in text.splitlines()
        if line.startswith("| `")
    }
    # Leaves only: a key whose default is a dataclass is a section heading, not a row.
    leaves = set()
    for key in valid_keys():
        node = RLConfig()
        for part in key.split("."):
            node = getattr(node, part)
        if not dataclasses.is_dataclass(node):
            leaves.add(key)
    assert rows == leaves
    assert "| `actor.lr` | `float` | `1e-06` |" in text
    assert "| `trainer.output_dir` | `str` | `outputs/${trainer.experiment_name}` |" in text


def test_command_writes_the_same_bytes(tmp_path):
    out = tmp_path / "config.md"
    cmd = [sys.executable, "-m", "rlcli.cli", "config", "docs", "--output", str(out)]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert out.read_text() == render_config_reference()[0]
