"""The engine's speedups: code that only makes a pass cheaper, never what a map means. Each piece is behind its own
switch (:data:`SPEEDUPS`); with every one off, the engine computes the same maps by plain autograd and plain
forwards (tested family by family in ``tests/test_speedups.py``).

``EXPLAIN_SPEEDUPS`` in the environment sets them for every call: ``0`` switches all off, ``1`` (or unset) all on,
and a comma-separated list of names keeps those alone on (``EXPLAIN_SPEEDUPS=rows,folding``). It is read at each
pass, so a test or a user may change it between calls.
"""

from __future__ import annotations

import os

from ...errors import ExplainError

SPEEDUPS = {
    "rows": "a sequence model's position-wise layers and attention differentiated at the rows a score reaches "
    "(explain.core.speedups.rows)",
    "windows": "a YOLO head's local branches differentiated over the windows a detection reads "
    "(explain.core.speedups.windows)",
    "box_heads": "an R-CNN's box head differentiated at its kept detections alone (explain.core.speedups.box_heads)",
    "prefix": "masked copies scored through the local prefix they share with their image "
    "(explain.core.speedups.prefix)",
    "folding": "scoring forwards through a copy with its batch norms folded (explain.core.speedups.folding)",
    "channels_last": "scoring forwards on the CPU in channels-last memory (explain.core.speedups.folding)",
    "tails": "copies of one image that differ only in a layer's output run the image once up to the layer "
    "(explain.core.speedups.tails)",
    "narrow_watch": "the watch of a call's own forward on a convolutional network hooks the recorded layers, the "
    "modules around them and their children, not every module (explain.core.speedups.narrow_watch)",
    "layer_in_pass": "the automatic layer settled by the call's own pass among the last candidates, and on a model "
    "not seen before, by the trace's own forward as that pass, rather than by a search of its own "
    "(explain.core.speedups.settling)",
}
"""Each speedup's name and what it spares."""

VARIABLE = "EXPLAIN_SPEEDUPS"


def enabled(name: str) -> bool:
    """Whether the speedup ``name`` (one of :data:`SPEEDUPS`) is on, as ``EXPLAIN_SPEEDUPS`` says.

    Raises:
        ExplainError: The variable names a speedup that does not exist.
    """
    value = os.environ.get(VARIABLE, "1").strip().lower()
    if value in ("", "1", "on", "true", "all"):
        return True
    if value in ("0", "off", "false", "none"):
        return False
    chosen = {part.strip() for part in value.split(",") if part.strip()}
    unknown = sorted(chosen - set(SPEEDUPS))
    if unknown:
        raise ExplainError(f"{VARIABLE}={value}: no speedup {unknown[0]!r}; the speedups are {', '.join(SPEEDUPS)}")
    return name in chosen
