"""Loading a run's config: defaults <- recipe YAML <- command-line dot-list overrides.

Every mistake becomes a :class:`~rlcli.errors.UserError` that names the key, file or line. The
schema (one dataclass per component) is ``rlcli.config.schema``; the checks that need more than types
are ``rlcli.validation.validate``.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from rlcli.config.schema import RLConfig, valid_keys
from rlcli.errors import UserError
from rlcli.validation.peer_names import peer_name_suggestion
from rlcli.validation.validate import validate


def load_config(recipe: str | os.PathLike | None, overrides: list[str] = ()) -> RLConfig:
    """Merge defaults <- recipe YAML <- dot-list overrides, validate, and return a typed config."""
    merged = OmegaConf.structured(RLConfig)
    if recipe is not None:
        merged = _merge(merged, _read_recipe(Path(recipe)), source=str(recipe))
    if overrides:
        merged = _merge(merged, _parse_overrides(overrides), source="command line")
    try:
        OmegaConf.resolve(merged)
        cfg: RLConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as err:
        raise UserError(f"cannot resolve the config: {_omegaconf_message(err)}") from None
    validate(cfg)
    return cfg


def _read_recipe(path: Path) -> DictConfig:
    if not path.is_file():
        raise UserError(f"recipe file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err)
        raise UserError(f"invalid YAML in {path}{where}: {problem}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise UserError(f"{path}: a recipe must be a mapping of sections (data:, model:, ...)")
    return OmegaConf.create(raw)


def _parse_overrides(overrides: list[str]) -> DictConfig:
    for item in overrides:
        key = item.split("=", 1)[0]
        if "=" not in item or not key:
            raise UserError(f"override {item!r} must look like key=value (e.g. actor.lr=1e-5)")
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except OmegaConfBaseException as err:
        raise UserError(f"cannot parse overrides {list(overrides)}: {err}") from None


def _merge(base: DictConfig, update: DictConfig, source: str) -> DictConfig:
    try:
        return OmegaConf.merge(base, update)  # type: ignore[return-value]
    except ConfigKeyError as err:
        full_key = _typed_key(update, _full_key(err))
        raise UserError(f"{source}: unknown config key '{full_key}'{_suggest(full_key)}") from None
    except ValidationError as err:
        raise UserError(f"{source}: {_omegaconf_message(err)}") from None
    except OmegaConfBaseException as err:
        raise UserError(f"{source}: {_omegaconf_message(err)}") from None
    except TypeError:  # OmegaConf: "Cannot merge incompatible container types", no key named
        found = _container_mismatch(
            OmegaConf.to_container(base, resolve=False), OmegaConf.to_container(update)
        )
        key, expected, got = found or ("a value", "of the type its key declares", "another")
        raise UserError(f"{source}: {key} must be {expected}, got {got}") from None


_KINDS = {dict: "a mapping (key: value, e.g. '{method: strict}')", list: "a list ([a, b])"}


def _typed_key(update: DictConfig, unknown: str) -> str:
    """The whole key the user typed under an unknown section (``actor_rollout_ref`` ->
    ``actor_rollout_ref.actor.optim.lr``), so the suggestion can know verl's name for it."""
    node: Any = OmegaConf.to_container(update)
    parts = unknown.split(".") if unknown else []
    for part in parts:
        if not isinstance(node, dict) or part not in node:
            return unknown
        node = node[part]
    while isinstance(node, dict) and len(node) == 1:
        ((part, node),) = node.items()
        parts.append(str(part))
    return ".".join(parts)


def _container_mismatch(base: Any, update: Any, prefix: str = "") -> tuple[str, str, str] | None:
    """The first key whose value in `update` is a list where `base` has a mapping, or the other
    way round, with what was expected and what was given; None when there is none."""
    for key, value in update.items():
        have = base.get(key) if isinstance(base, dict) else None
        name = f"{prefix}{key}"
        for kind in (dict, list):
            if isinstance(have, kind) and not isinstance(value, kind):
                return name, _KINDS[kind], repr(value)
        if isinstance(value, (dict, list)) and not isinstance(have, (dict, list, type(None))):
            return name, f"a single value like {have!r}", repr(value)
        if isinstance(have, dict) and isinstance(value, dict):
            found = _container_mismatch(have, value, prefix=f"{name}.")
            if found is not None:
                return found
    return None


def _full_key(err: OmegaConfBaseException) -> str:
    key = getattr(err, "full_key", None) or getattr(err, "key", None) or ""
    return str(key)


# OmegaConf's words for a value outside a Literal field's choices.
_NOT_A_CHOICE = re.compile(r"Invalid value '(?P<value>.*)', expected one of \[(?P<choices>.*)\]")


def _omegaconf_message(err: OmegaConfBaseException) -> str:
    msg = (getattr(err, "msg", None) or str(err)).splitlines()[0]
    key = _full_key(err)
    choice = _NOT_A_CHOICE.match(msg)
    if choice and key:  # the choices are the field's Literal type (rlcli.config.schema)
        return f"{key}={choice['value']!r} is not valid; choose one of: {choice['choices']}"
    return f"{key}: {msg}" if key else msg


def _suggest(full_key: str) -> str:
    candidates = valid_keys()
    peer = peer_name_suggestion(full_key, set(candidates))
    if peer is not None:
        return f"; did you mean '{peer}'? (rlcli's name for it)"
    close = difflib.get_close_matches(full_key, candidates, n=1, cutoff=0.5)
    if not close:  # a typo in the last part: compare within the same section
        section, _, leaf = full_key.rpartition(".")
        siblings = [k.rpartition(".")[2] for k in candidates if k.rpartition(".")[0] == section]
        close = [
            f"{section}.{m}" if section else m
            for m in difflib.get_close_matches(leaf, siblings, n=1)
        ]
    return f"; did you mean '{close[0]}'?" if close else ""
