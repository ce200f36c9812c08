"""Every config key does something: each dataclass field of ``RLConfig`` is read somewhere in the
product (``rlcli/``, ``parallel/``) outside the config modules themselves. A key that nothing
reads gives a user who sets it no effect and no error."""

from __future__ import annotations

import ast
from dataclasses import fields, is_dataclass
from pathlib import Path

from rlcli.config.schema import EngineConfig, RLConfig, TrainedModelConfig

ROOT = Path(__file__).resolve().parents[2]
# Where keys are declared, loaded and checked: reading a key there does not make it do anything.
CONFIG_MODULES = {
    "rlcli/config/schema.py",
    "rlcli/config/engine.py",
    "rlcli/config/rewards.py",
    "rlcli/validation/loader.py",
    "rlcli/validation/validate.py",
    "rlcli/validation/rewards.py",
}

# A section type shared by several sections (``actor.*`` and ``critic.*`` are both
# TrainedModelConfig; ``rollout.*`` and ``reward.judge.*`` are EngineConfigs) is read by functions
# that take the section as a parameter of this name.
SHARED_SECTION_READER = "section"
SHARED_SECTIONS = (TrainedModelConfig, EngineConfig)

# Keys read by something other than a `.name` attribute access, each with the reader.
READ_GENERICALLY = {
    # Only asserts the derived data-parallel size; read by derive_dp in config_validation.
    "parallel.dp",
}


def _dotted_fields(node: type = RLConfig, prefix: str = "") -> list[tuple[str, str]]:
    """(dotted key, attribute name) of every leaf field, e.g. ("actor.lr", "lr")."""
    return [(key, name) for key, name, _ in _leaf_fields(node, prefix)]


def _leaf_fields(node: type = RLConfig, prefix: str = "") -> list[tuple[str, str, type]]:
    """(dotted key, attribute name, the section class declaring it) of every leaf field."""
    out = []
    for f in fields(node):
        default = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
        if is_dataclass(default):
            out.extend(_leaf_fields(type(default), prefix=f"{prefix}{f.name}."))
        else:
            out.append((f"{prefix}{f.name}", f.name, node))
    return out


def _shared(section: type) -> bool:
    """Whether ``section`` is a shared section type (or extends one), whose fields the readers
    of the shared type may read (an engine reads ``section.sleep_level`` of ``rollout.*``)."""
    return any(issubclass(section, shared) for shared in SHARED_SECTIONS)


def _owner(node: ast.expr) -> str:
    """The last name of the object an attribute is read from: `cfg.actor` -> "actor"."""
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return ""


def _attribute_reads() -> tuple[set[tuple[str, str]], dict[str, set[str]]]:
    """(owner, name) of every `owner.name` read and `getattr(owner, "name")` in product code
    outside the config modules (`cfg.actor.lr` gives ("actor", "lr")), and the local names
    bound to a section (`r = cfg.rollout` makes "r" an alias of "rollout")."""
    names: set[tuple[str, str]] = set()
    aliases: dict[str, set[str]] = {}
    for package in ("rlcli", "parallel"):
        for path in (ROOT / package).rglob("*.py"):
            if str(path.relative_to(ROOT)) in CONFIG_MODULES:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if (
                    isinstance(node, ast.Assign)
                    and len(node.targets) == 1
                    and isinstance(node.targets[0], ast.Name)
                    and isinstance(node.value, ast.Attribute)
                ):
                    aliases.setdefault(node.value.attr, set()).add(node.targets[0].id)
                if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                    names.add((_owner(node.value), node.attr))
                elif (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Name)
                    and node.func.id == "getattr"
                    and len(node.args) >= 2
                    and isinstance(node.args[1], ast.Constant)
                ):
                    names.add((_owner(node.args[0]), str(node.args[1].value)))
    return names, aliases


def test_every_config_field_is_read() -> None:
    read, aliases = _attribute_reads()
    unread = []
    for key, name, declaring in _leaf_fields():
        section = key.split(".")[-2]
        owners = {section, *aliases.get(section, ())}
        if _shared(declaring):
            owners.add(SHARED_SECTION_READER)
        if not any((owner, name) in read for owner in owners):
            unread.append(key)
    unread = [key for key in unread if key not in READ_GENERICALLY]
    assert not unread, f"config keys that nothing reads (remove or implement them): {unread}"


def test_allow_list_names_existing_keys() -> None:
    keys = {key for key, _ in _dotted_fields()}
    assert READ_GENERICALLY <= keys, sorted(READ_GENERICALLY - keys)


def test_walk_finds_nested_fields() -> None:
    keys = dict(_dotted_fields())
    assert keys["algorithm.kl_ctrl.horizon"] == "horizon"
    assert keys["model.spec.hidden_size"] == "hidden_size"
    assert "algorithm.kl_ctrl" not in keys
