"""``python -m explain``: the same as the ``explain`` command."""

from .cli import main

raise SystemExit(main())
