"""What ``explain`` offers by name, readable without importing torch (``explain --method list``, ``--help``).

The method classes live in :mod:`explain.methods`; the list of methods is read from their source (each class's
``name``, ``title``, ``fast`` and ``cost``), so that it needs no torch, and ``explain.METHODS``, ``__all__`` and
the command line's list follow from it.
"""

from __future__ import annotations

import ast
import difflib
import re
from dataclasses import dataclass
from pathlib import Path

from .errors import ExplainError

FUSIONS = ("mean", "max", "product")  # how several layers' maps become one (``fuse=``, ``--fuse``)


@dataclass(frozen=True)
class MethodEntry:
    """One CAM method, as its class says it.

    Attributes:
        name: The name the API and the CLI take (``method="gradcampp"``): the class's ``name``.
        cls: Its class's name.
        module: The module that defines it, relative to the package (``methods.gradient``).
        title: What it is, in a few words, with its paper: the class's ``title``.
        fast: One forward and at most one backward per target: part of ``--method all`` (the class's ``fast``).
        cost: What makes a call slow, for a method of many passes (the explorer shows it); None for the others.
    """

    name: str
    cls: str
    module: str
    title: str
    fast: bool = True
    cost: str | None = None


# The modules that define methods, relative to the package, in the order the catalog lists their methods (a test
# holds every module of explain.methods and explain.relevance.propagation here).
METHOD_MODULES = (
    "methods.gradient", "methods.activation", "methods.factorization", "methods.scales", "methods.guided",
    "methods.perturbation", "methods.rollout", "methods.chefer", "methods.legrad", "methods.attribution",
    "relevance.propagation", "methods.masking", "methods.superpixels",
)  # fmt: skip
_FIELDS = ("name", "title", "fast", "cost")


_CLASS = re.compile(r"class (\w+)\b")
_FIELD = re.compile(r"    (name|title|fast|cost) = (.+)$")  # a class's own attribute, on its line


def _entries(module: str) -> list[MethodEntry]:
    """The methods a module (relative to the package) defines: each class that sets its ``name`` and ``title``,
    read from its source line by line (without importing it: no torch, and a tenth of a parse's time), in the
    order the module defines them. A test holds each entry equal to what the imported class says."""
    source = Path(__file__).parent.joinpath(*module.split(".")).with_suffix(".py").read_text(encoding="utf-8")
    classes: list[tuple[str, dict[str, object]]] = []
    for line in source.splitlines():
        opened, field = _CLASS.match(line), _FIELD.match(line)
        if opened:
            classes.append((opened[1], {}))
        elif field and classes:
            classes[-1][1][field[1]] = ast.literal_eval(field[2])
    return [
        MethodEntry(str(found.pop("name")), cls, module, **found)  # type: ignore[arg-type]
        for cls, found in classes
        if "name" in found and "title" in found
    ]


METHOD_CATALOG: tuple[MethodEntry, ...] = tuple(entry for module in METHOD_MODULES for entry in _entries(module))
"""Every method, read from its class: adding one is its class (with ``name`` and ``title``) and its tests."""

METHOD_NAMES = [entry.name for entry in METHOD_CATALOG]
FAST_METHOD_NAMES = [entry.name for entry in METHOD_CATALOG if entry.fast]  # what ``--method all`` compares
ALL_METHODS = "all"  # the CLI's name for one comparison grid of every fast method per image


@dataclass(frozen=True)
class MetricEntry:
    """One faithfulness metric of ``--metrics`` (see :mod:`explain.metrics`).

    Attributes:
        name: The name ``--metrics`` takes.
        title: What each image's value is.
        better: ``"lower"`` or ``"higher"``: which way a more faithful map moves it.
    """

    name: str
    title: str
    better: str


METRIC_CATALOG: tuple[MetricEntry, ...] = (
    MetricEntry("deletion", "deletion AUC (RISE)", "lower"),
    MetricEntry("insertion", "insertion AUC (RISE)", "higher"),
    MetricEntry("drop", "Average Drop, %", "lower"),
    MetricEntry("increase", "Increase in Confidence, %", "higher"),
    MetricEntry("gain", "Average Gain, %", "higher"),
    MetricEntry("road", "ROAD, (LeRF - MoRF) / 2", "higher"),
)
METRIC_NAMES = [entry.name for entry in METRIC_CATALOG]


def check_metrics(text: str) -> list[str]:
    """The metric names of a comma-separated list, in catalog order.

    Raises:
        ExplainError: A name is not a metric's.
    """
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in METRIC_NAMES]
    if unknown or not names:
        raise ExplainError(
            f"unknown metric(s) {', '.join(map(repr, unknown)) or 'none given'}; known: {', '.join(METRIC_NAMES)}"
        )
    return [name for name in METRIC_NAMES if name in names]


def check_method(name: str) -> None:
    """Refuse a name that is not a method's, suggesting close ones.

    Raises:
        ExplainError: The name is unknown.
    """
    if name not in METHOD_NAMES:
        close = difflib.get_close_matches(name, METHOD_NAMES, n=3, cutoff=0.5)
        hint = f"did you mean: {', '.join(close)}" if close else f"known: {', '.join(METHOD_NAMES)}"
        raise ExplainError(f"unknown method {name!r}; {hint}")


def method_table() -> str:
    """One line per method: its name, what it is, and whether ``--method all`` includes it."""
    rows = []
    for entry in METHOD_CATALOG:
        cost = "fast, in --method all" if entry.fast else "not in --method all"
        rows.append(f"{entry.name:20} {entry.title:45} {cost}")
    return "\n".join(rows)
