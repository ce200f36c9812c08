"""The one registry helper: names to objects, a second registration of a name refused, an unknown
name answered with the valid choices (and the config key and other accepted forms, when given)."""

from __future__ import annotations

import pytest

from algorithms.registry import Registry


class Refused(Exception):
    pass


def test_register_lookup_and_mapping():
    registry: Registry = Registry("widget")

    @registry.register("b")
    def b():
        return "b"

    registry["a"] = len
    assert registry.lookup("b") is b and registry["a"] is len
    assert "a" in registry and sorted(registry) == registry.names() == ["a", "b"]
    registry.register("b")(b)  # the same object again: nothing changes
    with pytest.raises(ValueError, match="widget 'b' is already registered to .*b"):
        registry["b"] = len
    del registry["a"]
    assert registry.names() == ["b"] and len(registry) == 1


def test_an_unknown_name_names_the_valid_choices():
    plain: Registry = Registry("widget")
    plain["x"], plain["y"] = 1, 2
    with pytest.raises(ValueError, match=r"^unknown widget 'z'; valid names: x, y$"):
        plain.lookup("z")
    keyed: Registry = Registry("widget", error=Refused, key="a.b", alternatives=", or 'm:C'")
    keyed["x"] = 1
    with pytest.raises(Refused, match=r"^a.b='z': unknown widget; valid names: x, or 'm:C'$"):
        keyed.lookup("z")
