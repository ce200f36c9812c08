"""The docs check: every ```bash block in README.md and docs/*.md runs, so examples stay true.

Blocks run in order (README first, then docs/quickstart.md, then the other pages by name) in one
shared working directory that links the repository's recipes/ and examples/, with ``rlcli`` as
``python -m rlcli.cli`` of this checkout and the test's python first on PATH. A block passes when
its shell script exits 0 (``set -e``: every command in it must succeed).

Marker lines (HTML comments, invisible on GitHub) right before a block adjust how it runs:

- ``<!-- docs-check: with KEY=VALUE ... -->`` appends these overrides to every ``rlcli train`` /
  ``rlcli sft`` in the block (small settings where the real run is long);
- ``<!-- docs-check: before CMD -->`` runs CMD first (e.g. writes a tiny input file);
- ``<!-- docs-check: instead CMD -->`` runs CMD in place of the block (``make`` targets, which
  would install a venv: CMD is what the target runs, with small settings);
- ``<!-- docs-check: exit N -->`` the block's last command is expected to exit N (e.g. a plan
  that does not fit exits 1);
- ``<!-- docs-check: dist -->`` the block starts several processes (torchrun): marked
  ``@pytest.mark.dist`` so ``make test-fast`` leaves it out;
- ``<!-- docs-check: vllm -->`` the block needs the vLLM engine (a run with the recipe's engine,
  or one that reads such a run's output): marked ``@pytest.mark.vllm`` and skipped where vLLM is
  not installed (``make test-mcore19``);
- ``<!-- docs-check: skip (REASON) -->`` does not run it; the reason is required and shown.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"^\s*<!--\s*docs-check:\s*(?P<body>.*?)\s*-->\s*$")
DIRECTIVES = ("with", "before", "instead", "exit", "dist", "vllm", "skip")
# Only a guard against a hung block, far above what any block takes: the README's GSM8K block (two
# training runs, an SFT and a 4-process conversion check) took 340-415 s on a loaded 2-core machine, so a
# 600 s limit failed it under two workers' load (the blocks are what is checked, not their speed).
BLOCK_TIMEOUT_S = 1800


@dataclass
class DocBlock:
    file: str
    line: int
    script: str
    directives: list[tuple[str, str]] = field(default_factory=list)

    def get(self, name: str) -> list[str]:
        return [value for key, value in self.directives if key == name]


def _doc_files() -> list[Path]:
    pages = sorted((ROOT / "docs").glob("*.md"), key=lambda p: (p.name != "quickstart.md", p.name))
    return [ROOT / "README.md", *pages]


def parse_blocks(path: Path) -> list[DocBlock]:
    """The ```bash blocks of one Markdown file with the marker directives right above each."""
    blocks, pending, body, start = [], [], None, 0
    rel = str(path.relative_to(ROOT))
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if body is not None:
            if line.strip() == "```":
                blocks.append(DocBlock(rel, start, "\n".join(body) + "\n", pending))
                body, pending = None, []
            else:
                body.append(line)
            continue
        if line.strip() == "```bash":
            body, start = [], number
            continue
        match = MARKER.match(line)
        if match:
            name, _, value = match["body"].partition(" ")
            if name not in DIRECTIVES:
                raise ValueError(f"{rel}:{number}: unknown docs-check directive {name!r}")
            pending.append((name, value.strip()))
        elif line.strip():
            pending = []  # a marker belongs to the block right after it (blank lines allowed)
    return blocks


ALL_BLOCKS = [block for path in _doc_files() for block in parse_blocks(path)]

# `rlcli` is this checkout's CLI; train/sft get the block's small settings appended.
PRELUDE = """set -e -o pipefail
rlcli() {
  case "$1" in
    train|sft)
      local extra
      read -ra extra <<< "$DOCS_CHECK_OVERRIDES"  # split on spaces, no globbing of [a,b] lists
      "$RLCLI_PY" -m rlcli.cli "$@" "${extra[@]}" ;;
    *) "$RLCLI_PY" -m rlcli.cli "$@" ;;
  esac
}
"""


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """One directory shared by all blocks, so a later page can use an earlier page's run."""
    work = tmp_path_factory.mktemp("docs_check")
    for name in ("recipes", "examples"):
        (work / name).symlink_to(ROOT / name)
    return work


def test_every_skip_says_why():
    for block in ALL_BLOCKS:
        for reason in block.get("skip"):
            assert re.fullmatch(r"\(.{8,}\)", reason), f"{block.file}:{block.line}: skip (REASON)"


def test_docs_have_command_blocks():
    files = {block.file for block in ALL_BLOCKS}
    assert "README.md" in files and "docs/quickstart.md" in files


def _param(block: DocBlock):
    marks = [pytest.mark.dist] if block.get("dist") else []
    marks += [pytest.mark.vllm] if block.get("vllm") else []
    return pytest.param(block, id=f"{block.file}:{block.line}", marks=marks)


@pytest.mark.parametrize("block", [_param(block) for block in ALL_BLOCKS])
def test_doc_block_runs(block: DocBlock, workdir: Path):
    if block.get("skip"):
        pytest.skip(f"{block.file}:{block.line} {block.get('skip')[0]}")
    if block.get("vllm") and importlib.util.find_spec("vllm") is None:
        pytest.skip(f"{block.file}:{block.line} needs vLLM, which is not installed")
    instead = block.get("instead")
    script = "\n".join(instead) + "\n" if instead else block.script
    expected = int(block.get("exit")[0]) if block.get("exit") else 0
    if expected:
        # The last line's status is the block's: run it outside `set -e` and compare.
        lines = script.rstrip("\n").replace("\\\n", " ").split("\n")  # join continuations
        script = "\n".join(
            [*lines[:-1], "set +e", lines[-1], f"status=$?; [ $status -eq {expected} ] || exit 100"]
        )
    full = PRELUDE + "\n".join(block.get("before")) + "\n" + script
    env = dict(os.environ)
    env.update(
        RLCLI_PY=sys.executable,
        PYTHONPATH=f"{ROOT}{os.pathsep}{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(ROOT),
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        DOCS_CHECK_OVERRIDES=" ".join(block.get("with")),
        OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
    )
    result = subprocess.run(
        ["bash", "-c", full],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT_S,
    )
    assert result.returncode == 0, (
        f"{block.file}:{block.line}: the docs' command block failed (exit {result.returncode})\n"
        f"--- script ---\n{script}--- stdout (tail) ---\n{result.stdout[-3000:]}\n"
        f"--- stderr (tail) ---\n{result.stderr[-3000:]}"
    )
