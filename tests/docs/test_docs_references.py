"""The docs name only things that exist: config keys, relative links and their #anchors."""

from __future__ import annotations

import re
from pathlib import Path

from rlcli.config.schema import valid_keys

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SECTIONS = (
    "data|model|parallel|rollout|actor|ref|algorithm|reward|sft|rm|"
    "trainer|logging|checkpoint|critic"
)
KEY = re.compile(rf"^(?:{SECTIONS})\.[A-Za-z0-9_.*]+$")
# Keys the docs describe that land with work being merged (reliability, throughput, PPO). When
# one exists, this test says to drop it here and the docs-check skip marker of its block.
PENDING_KEYS: set[str] = set()
# Free-form dictionaries: any sub-key is valid.
OPEN_PREFIXES = ("reward.kwargs.",)
# HF checkpoints' tensor names, which start like the `model` section's keys
HF_TENSOR_PREFIXES = ("model.layers", "model.language_model", "model.embed_tokens", "model.norm",
                      "model.visual")  # fmt: skip


def _config_keys_named(path: Path) -> set[str]:
    """Dotted config keys in the backtick spans of a page. In the verl porting page only the
    rlcli column (the second cell of a table row) is rlcli's."""
    text = path.read_text()
    if path.name == "porting-from-verl.md":
        text = "\n".join(line.split("|")[2] for line in text.splitlines() if line.count("|") >= 4)
    names = set()
    for span in re.findall(r"`([^`\n]+)`", text):
        for token in re.split(r"[\s/,]+", span):
            if "(" in token:  # a function call such as parallel.model.build_model(...)
                continue
            token = token.split("=", 1)[0].rstrip(".:;")
            if token.endswith(".py") or _is_python_module(token):
                continue
            if token.startswith(HF_TENSOR_PREFIXES):
                continue
            if KEY.match(token) and not token.endswith("."):
                names.add(token)
    return names


def _is_python_module(token: str) -> bool:
    """`parallel.parity`, `parallel.hf_model.load_hf_model`: a module of this repository."""
    parts = token.split(".")
    return len(parts) >= 2 and (
        (ROOT / parts[0] / f"{parts[1]}.py").is_file() or (ROOT / parts[0] / parts[1]).is_dir()
    )


def _is_valid(key: str, valid: set[str]) -> bool:
    if key.startswith(OPEN_PREFIXES):
        return True
    if "*" in key:
        prefix = key.split("*", 1)[0]
        return any(k.startswith(prefix) for k in valid)
    return key in valid


def test_docs_name_only_existing_config_keys():
    valid = set(valid_keys())
    unknown = {
        f"{path.relative_to(ROOT)}: {key}"
        for path in DOCS
        for key in _config_keys_named(path)
        if not _is_valid(key, valid) and key not in PENDING_KEYS
    }
    assert not unknown, f"the docs name config keys that do not exist: {sorted(unknown)}"


def test_pending_keys_are_still_pending():
    landed = sorted(PENDING_KEYS & set(valid_keys()))
    assert not landed, (
        f"{landed} exist now: remove them from PENDING_KEYS in {Path(__file__).name} and the "
        "`<!-- docs-check: skip (lands with ...) -->` marker of the blocks that use them"
    )


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    anchors = set()
    for line in path.read_text().splitlines():
        match = re.match(r"^#+\s+(.*)$", line)
        if match:
            slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
            anchors.add(slug)
    return anchors


def test_relative_links_and_anchors_resolve():
    broken = []
    for path in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if re.match(r"^[a-z]+:", target):
                continue  # http(s):, mailto:
            file_part, _, anchor = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            if not linked.exists():
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "broken links in the docs:\n" + "\n".join(broken)
