"""``rlcli config docs [--output docs/config.md]``: the config reference, generated from the config
dataclasses so it cannot drift from the code.

Every key's type and default come from the dataclasses themselves; its one-line meaning comes
from the source of the config modules (``CONFIG_MODULES``): the comment on the field's line(s), or the comment lines right above
the field. A section's description is its class docstring. The output is
deterministic, so ``tests/docs`` regenerates it and compares byte for byte with the committed file.

Mounted by rlcli.cli as ``config.config_app.command("docs")(docs.config_docs)``.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import io
import json
import tokenize
from pathlib import Path
from typing import Any, Optional

import typer

REGENERATE = "rlcli config docs --output docs/config.md"
# Every module that declares config sections; ``rlcli.config.schema`` assembles them into ``RLConfig``.
CONFIG_MODULES = (
    "rlcli.config.schema",
    "rlcli.config.model",
    "rlcli.config.agentic",
    "rlcli.config.algorithm",
    "rlcli.config.engine",
    "rlcli.config.rewards",
)


def _comments_by_line(source: str) -> dict[int, str]:
    """{line number: comment text without '#'} for every comment token in `source`."""
    comments = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    return comments


def _field_sources(source: str) -> dict[str, dict[str, dict[str, str]]]:
    """{class name: {field name: {"type": annotation, "meaning": comment}}} from the source.

    A field's meaning is the comment on any of its own lines (a multi-line default may carry it
    inside the parentheses); failing that, the block of comment-only lines right above it."""
    comments = _comments_by_line(source)
    lines = source.splitlines()
    classes: dict[str, dict[str, dict[str, str]]] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        entries = {}
        for stmt in node.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            own = [comments[n] for n in range(stmt.lineno, stmt.end_lineno + 1) if n in comments]
            above = []
            n = stmt.lineno - 1
            while n in comments and lines[n - 1].lstrip().startswith("#"):
                above.insert(0, comments[n])
                n -= 1
            entries[stmt.target.id] = {
                "type": ast.unparse(stmt.annotation),
                "meaning": " ".join(own or above),
            }
        classes[node.name] = entries
    return classes


def _format_default(value: Any) -> str:
    """A default as a user would write it in a recipe (YAML-like)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value) if value == "" else value
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return repr(value)


def _cell(text: str) -> str:
    """Markdown table cell: a literal '|' would end the cell."""
    return text.replace("|", "\\|")


def _default_of(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return f.default


def _section(cls: type, prefix: str, sources: dict, out: list[str], missing: list[str]) -> None:
    """Append `cls`'s table (and its nested sections after it) to `out`."""
    nested = []
    rows = []
    for f in dataclasses.fields(cls):
        default = _default_of(f)
        key = f"{prefix}.{f.name}"
        if dataclasses.is_dataclass(default):
            nested.append((type(default), key))
            continue
        # A field declared by a shared base section (e.g. TrainedModelConfig) is documented there.
        info = next(
            (
                sources[base.__name__][f.name]
                for base in cls.__mro__
                if f.name in sources.get(base.__name__, {})
            ),
            {"type": str(f.type), "meaning": ""},
        )
        if not info["meaning"]:
            missing.append(key)
        rows.append(
            f"| `{key}` | `{_cell(info['type'])}` | `{_cell(_format_default(default))}` "
            f"| {_cell(info['meaning'])} |"
        )
    out.append(f"## `{prefix}`")
    out.append("")
    doc = inspect.getdoc(cls)
    if doc and not doc.startswith(cls.__name__ + "("):  # dataclass's generated signature
        out.append(" ".join(doc.split()))
        out.append("")
    for _, sub_key in nested:
        out.append(f"Subsection: [`{sub_key}`](#{sub_key.replace('.', '')}).")
        out.append("")
    if rows:
        out.append("| key | type | default | meaning |")
        out.append("| --- | --- | --- | --- |")
        out.extend(rows)
        out.append("")
    for sub_cls, sub_key in nested:
        _section(sub_cls, sub_key, sources, out, missing)


def render_config_reference() -> tuple[str, list[str]]:
    """(the Markdown reference, the keys whose field has no comment in the config modules)."""
    from rlcli.config.schema import RLConfig

    sources: dict[str, dict[str, Any]] = {}
    for name in CONFIG_MODULES:
        module = importlib.import_module(name)
        sources.update(_field_sources(Path(inspect.getsourcefile(module)).read_text()))
    files = [f"`{name.replace('.', '/')}.py`" for name in CONFIG_MODULES]
    out = [
        "# Config reference",
        "",
        f"Generated from the dataclasses in {', '.join(files[:-1])} and {files[-1]} by "
        f"`{REGENERATE}`; do not edit "
        "by hand (a test fails when this file is stale).",
        "",
        "A recipe (YAML) holds only what differs from these defaults; any key can also be given "
        "on the command line as a dot-list override, e.g. `actor.lr=1e-5`. "
        "`rlcli config show RECIPE [overrides]` prints the fully resolved config.",
        "",
        "Sections: "
        + ", ".join(f"[`{f.name}`](#{f.name})" for f in dataclasses.fields(RLConfig))
        + ".",
        "",
    ]
    missing: list[str] = []
    for f in dataclasses.fields(RLConfig):
        _section(type(_default_of(f)), f.name, sources, out, missing)
    return "\n".join(out).rstrip("\n") + "\n", missing


def config_docs(
    output: Optional[Path] = typer.Option(
        None, "--output", "-o", help="Write the Markdown here (default: print it)."
    ),
):
    """Generate the config reference (every key, type, default and meaning) as Markdown."""
    text, _ = render_config_reference()
    if output is None:
        typer.echo(text, nl=False)
        return
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text)
    typer.echo(f"wrote {output}")
