"""Which method should I trust here? ``explain evaluate`` scores a grid of methods and layers with the field's
metrics on the user's own images, with bootstrap intervals, and ranks them: :func:`evaluate` runs it
(``run.py``), :mod:`.catalog` names the metrics it runs, :mod:`.ranking` the intervals and the recommendation,
:mod:`.report` the files it writes."""

from .catalog import CATALOG, DEFAULT_METRICS
from .report import write_report
from .run import Configuration, Evaluation, evaluate

__all__ = ["CATALOG", "DEFAULT_METRICS", "Configuration", "Evaluation", "evaluate", "write_report"]
