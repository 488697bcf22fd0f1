"""Batch export: the run loop (``run.py``), its settings (``settings.py``), finding inputs (``inputs.py``),
loading them in batches (``loading.py``), naming and writing outputs (``outputs.py``), the manifest
(``manifest.py``), the gallery page (``gallery.py``), ``torchrun`` launches (``distributed.py``) and the metric
reports (``reports.py``). Only the command line imports this package; its modules import torch only where they
need it, so the command line's checks run without it."""
