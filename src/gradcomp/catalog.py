"""The catalogue of method names: ``@register`` puts a class under its ``name``.

A leaf module (it imports nothing of gradcomp), so that the methods can register themselves and
``gradcomp.registry`` can import the methods without an import circle.
"""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T", bound=type)

CATALOG: dict[str, type] = {}


def register(cls: T) -> T:
    """Class decorator: registers a compressor or scheme class under its ``name``."""
    name = getattr(cls, "name", "")
    if not name:
        raise TypeError(f"{cls.__name__} has no name")
    if name in CATALOG and CATALOG[name] is not cls:
        raise TypeError(f"compressor name {name!r} registered twice")
    CATALOG[name] = cls
    return cls
