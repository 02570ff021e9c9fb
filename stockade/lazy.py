"""Package attributes imported on first use (PEP 562 module `__getattr__`).

A package that re-exports its submodules' names would import all of them whenever any
one submodule is imported (Python imports the package first). The CLI builds its parser
from every component's `cli.py`, so `stockade sandbox kill` paid for aiohttp, the rule
loader and the event writer before it did anything. With `lazy_exports` a name is
imported when it is first used and then kept in the package like a normal attribute.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, where: Mapping[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` for `package`: `where` maps each exported name to the
    (relative) module that defines it."""

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        setattr(sys.modules[package], name, value)  # later lookups skip this function
        return value

    return __getattr__


def exports_of(modules: Mapping[str, tuple[str, ...]]) -> dict[str, str]:
    """{module: names} -> {name: module}, the form `lazy_exports` takes."""
    return {name: module for module, names in modules.items() for name in names}
