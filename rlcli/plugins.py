"""User code named in a config: ``package.module:Name`` or ``path/to/file.py:Name``.

Reward functions, tools and environments all resolve their user specs here, so the three accept
the same forms and fail with the same kind of message.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
from typing import Any

from rlcli.errors import UserError


def is_user_spec(spec: str) -> bool:
    """Whether ``spec`` names user code (``module:Name`` or ``file.py:Name``), not a builtin."""
    return ":" in spec


def load_user_object(spec: str, kind: str, member: str) -> tuple[Any, str]:
    """The object ``spec`` names, and the spec with a file path made absolute (so a worker
    process in another working directory can resolve it again).

    ``kind`` and ``member`` name what is being loaded in error messages: ``("reward function",
    "function")``, ``("tool", "class")``.
    Raises ``UserError`` naming the spec and the import error when it does not resolve.
    """
    if not is_user_spec(spec):
        raise UserError(f"{kind} {spec!r} is not of the form 'module:Name' or 'file.py:Name'")
    module_part, attribute = spec.rsplit(":", 1)
    if module_part.endswith(".py") or os.sep in module_part:
        module = _load_file(spec, module_part, kind)
        spec = f"{os.path.abspath(module_part)}:{attribute}"
    else:
        try:
            module = importlib.import_module(module_part)
        except Exception as error:
            raise UserError(
                f"{kind} {spec!r}: cannot import module {module_part!r}: "
                f"{type(error).__name__}: {error}"
            ) from error
    if not hasattr(module, attribute):
        raise UserError(f"{kind} {spec!r}: {module_part!r} has no {member} {attribute!r}")
    return getattr(module, attribute), spec


def _load_file(spec: str, path: str, kind: str) -> Any:
    if not os.path.isfile(path):
        raise UserError(f"{kind} {spec!r}: file not found: {path}")
    absolute = os.path.abspath(path)
    # A distinct, stable module name per file, so two user files named reward.py do not clash.
    digest = hashlib.sha1(absolute.encode()).hexdigest()[:12]
    module_name = f"rlcli_user_module_{digest}"
    module_spec = importlib.util.spec_from_file_location(module_name, absolute)
    if module_spec is None or module_spec.loader is None:
        raise UserError(f"{kind} {spec!r}: {path} cannot be loaded as a Python file")
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as error:
        raise UserError(
            f"{kind} {spec!r}: importing {path} failed: {type(error).__name__}: {error}"
        ) from error
    return module


def load_user_subclass(spec: str, base: type, kind: str, where: str, interface: str) -> type:
    """The class ``module:Class`` / ``path/file.py:Class`` names, checked to be a concrete
    subclass of ``base``; ``UserError`` prefixed by ``where`` otherwise. ``kind`` names it in
    messages ("a tool", "an environment"); ``interface`` lists the methods it must implement."""
    noun = kind.split(" ", 1)[-1]
    try:
        cls, _ = load_user_object(spec, noun, "class")
    except UserError as error:
        raise UserError(f"{where}: {error}") from None
    if not (inspect.isclass(cls) and issubclass(cls, base)):
        raise UserError(
            f"{where}: {spec!r} is not {kind} class: it must subclass "
            f"{base.__module__}.{base.__qualname__} ({interface})"
        )
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise UserError(f"{where}: {noun} class {spec!r} does not implement {missing}")
    return cls
