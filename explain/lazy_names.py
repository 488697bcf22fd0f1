"""Public names of a package imported from their modules on first use, so that importing the package loads no
torch (``explain --help``, the command line's checks)."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Collection, Mapping
from importlib import import_module
from typing import Any


def lazy_names(
    package: str,
    exports: Mapping[str, str],
    subpackages: Collection[str] = (),
    deprecated: Mapping[str, tuple[str, str, str]] | None = None,
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's module ``__getattr__`` and ``__dir__``: each name of ``exports`` is imported from its module
    (relative to the package) at its first look-up and kept in the package; each of ``subpackages`` is imported.

    Args:
        package: The package's ``__name__``.
        exports: Each public name and the module that defines it.
        subpackages: Subpackages reached as attributes after a plain import of the package.
        deprecated: Names that left the package's surface, kept for one release: each name's module (relative to
            the package), its name there, and where to find it now. Each look-up warns (``DeprecationWarning``)
            and works.
    """
    namespace, moved = sys.modules[package].__dict__, dict(deprecated or {})

    def __getattr__(name: str) -> Any:
        if name in subpackages:
            return import_module(f".{name}", package)
        if name in moved:
            module, attribute, instead = moved[name]
            warnings.warn(
                f"{package}.{name} is deprecated and leaves in the next release: use {instead}",
                DeprecationWarning,
                stacklevel=2,
            )
            return getattr(import_module(f".{module}", package), attribute)
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(f".{exports[name]}", package), name)
        namespace[name] = value  # later look-ups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *exports, *subpackages})

    return __getattr__, __dir__
