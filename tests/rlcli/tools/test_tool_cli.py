"""``rlcli tool call``: the response on stdout and exit 0 (error texts included); exit 2 for an
unknown tool or arguments that are not JSON; a bad tool config exits 2 from ``config validate``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlcli.cli import main

ROOT = Path(__file__).resolve().parents[3]


def _run(capsys, *argv) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(["tool", "call", *argv])
    captured = capsys.readouterr()
    return exit_info.value.code or 0, captured.out, captured.err


def test_builtin_calculator(capsys):
    code, out, err = _run(capsys, "calculator", '{"expression": "123 * 456"}')
    assert (code, out) == (0, "56088\n") and err.startswith("[ok, ")


def test_error_texts_exit_zero(capsys):
    assert _run(capsys, "calculator", '{"expression": "1/0"}')[:2] == (
        0,
        "Error: division by zero\n",
    )
    code, out, err = _run(capsys, "calculator", '{"expr": "1"}')
    assert code == 0 and out.startswith("Error: invalid arguments for calculator")
    assert err.startswith("[error, ")


def test_unknown_tool_and_bad_json_exit_2(capsys):
    code, out, err = _run(capsys, "search", "{}")
    assert code == 2 and out == ""
    assert "unknown tool 'search' among the built-in tools; tools: calculator, python" in err
    code, _, err = _run(capsys, "calculator", "{expression: 1}")
    assert code == 2 and "ARGS_JSON is not JSON" in err
    code, _, err = _run(capsys, "calculator", "{}", "--create-kwargs", "[")
    assert code == 2 and "--create-kwargs is not JSON" in err


def test_user_tool_from_a_config(capsys, tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text(yaml.safe_dump({"tools": ["tests.rlcli.tools.user_tools:LookupTool"]}))
    table = '{"table": {"capital": "Paris"}}'
    code, out, _ = _run(
        capsys, "lookup", '{"key": "capital"}', "--config", str(path), "--create-kwargs", table
    )
    assert (code, out) == (0, "Paris\n")
    code, _, err = _run(capsys, "calculator", '{"expression": "1"}', "--config", str(path))
    assert code == 2 and f"unknown tool 'calculator' in {path}; tools: lookup" in err


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
def test_python_tool_as_a_command(tmp_path):
    """The console command itself, in a fresh process, with the sandbox's timeout."""
    code = "import time\nprint('before', flush=True)\ntime.sleep(30)"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    path = tmp_path / "tools.yaml"
    path.write_text(yaml.safe_dump({"tools": [{"class": "python", "config": {"wall_time_s": 1}}]}))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlcli.cli",
            "tool",
            "call",
            "python",
            __import__("json").dumps({"code": code}),
            "--config",
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert (
        proc.stdout
        == "before\n[timed out after 1 s: the code and every process it started were stopped]\n"
    )


def test_config_validate_exits_2_naming_the_tool_config(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "tools": [
                    {
                        "class": "calculator",
                        "schema": {
                            "name": "c",
                            "parameters": {"type": "object", "properties": {"x": {"type": "nope"}}},
                        },
                    }
                ]
            }
        )
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlcli.cli",
            "config",
            "validate",
            str(ROOT / "recipes/quickstart.yaml"),
            "rollout.multi_turn.enable=true",
            f"rollout.multi_turn.tool_config={path}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"{path}: tools[0].schema.parameters: not a valid JSON schema" in proc.stderr
    assert "Traceback" not in proc.stderr
