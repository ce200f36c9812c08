"""Names a config selects -> the functions (or classes) they stand for: the one registry helper.

    POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")

    @POLICY_LOSSES.register("vanilla")
    def vanilla(...): ...

    POLICY_LOSSES.lookup("vanilla")   # ValueError naming the valid choices for an unknown name

Registering a name a second time with another object is an error (it would silently change what
existing configs run). A registry is a mapping (``name in registry``, ``sorted(registry)``).

It lives here, at the bottom of the project's layers (standard library only), so that
``algorithms``' own registries can use it and ``parallel`` and ``rlcli`` may import it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(MutableMapping[str, T], Generic[T]):
    """Objects by name, for one ``kind`` of thing (named in messages: "policy loss").

    Args:
        kind: what the entries are, singular.
        error: the exception an unknown name raises (``ValueError``; ``rlcli``'s registries raise
            ``UserError``, which reaches the user as a plain message).
        key: the config key that names an entry (shown in the unknown-name message).
        alternatives: what else the key accepts besides the names (", or 'module:function'").
    """

    def __init__(
        self,
        kind: str,
        *,
        error: type[Exception] = ValueError,
        key: str | None = None,
        alternatives: str = "",
    ) -> None:
        self.kind = kind
        self.error = error
        self.key = key
        self.alternatives = alternatives
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: make the decorated object selectable as ``name``."""

        def decorate(entry: T) -> T:
            self[name] = entry
            return entry

        return decorate

    def lookup(self, name: str) -> T:
        """The entry registered as ``name``; ``error`` naming the valid choices otherwise."""
        if name not in self._entries:
            raise self.error(self.unknown(name))
        return self._entries[name]

    def unknown(self, name: str, key: str | None = None) -> str:
        """The message for a name that is not registered (``key``: the config key that gave it,
        in place of the registry's)."""
        key = key or self.key
        where = f"{key}={name!r}: unknown {self.kind}" if key else f"unknown {self.kind} {name!r}"
        return f"{where}; valid names: {', '.join(self.names())}{self.alternatives}"

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self._entries)

    def __getitem__(self, name: str) -> T:
        return self._entries[name]

    def __setitem__(self, name: str, entry: T) -> None:
        registered = self._entries.get(name, entry)
        if registered is not entry:
            raise ValueError(
                f"{self.kind} {name!r} is already registered to "
                f"{getattr(registered, '__qualname__', repr(registered))}"
            )
        self._entries[name] = entry

    def __delitem__(self, name: str) -> None:
        del self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self.names())})"
