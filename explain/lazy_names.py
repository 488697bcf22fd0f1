"""Public names of a package imported from their modules on first use, so that importing the package loads no
torch (``explain --help``, the command line's checks)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Collection, Mapping
from importlib import import_module
from typing import Any


def lazy_names(
    package: str, exports: Mapping[str, str], subpackages: Collection[str] = ()
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's module ``__getattr__`` and ``__dir__``: each name of ``exports`` is imported from its module
    (relative to the package) at its first look-up and kept in the package; each of ``subpackages`` is imported.

    Args:
        package: The package's ``__name__``.
        exports: Each public name and the module that defines it.
        subpackages: Subpackages reached as attributes after a plain import of the package.
    """
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str) -> Any:
        if name in subpackages:
            return import_module(f".{name}", package)
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(f".{exports[name]}", package), name)
        namespace[name] = value  # later look-ups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *exports, *subpackages})

    return __getattr__, __dir__
