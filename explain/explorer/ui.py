"""What every part of the app's page needs of Gradio, apart from the page itself (:mod:`explain.explorer.web`):
Gradio imported on first use, the one thread every torch call of the app runs on, and handlers whose user errors
are shown in the page as one line. The panels (:mod:`explain.explorer.words`, :mod:`explain.explorer.concept_panel`)
import these, and the page imports the panels: no circle.
"""

from __future__ import annotations

import contextvars
import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from ..errors import ExplainError
from .session import Explorer


class Page(Protocol):
    """What a panel asks of the app: its explorer, and the handlers of the words' panel."""

    explorer: Explorer

    def explain_words(self, *args: Any) -> Any:
        """Explain the open photo's words (see :class:`explain.explorer.web.App`)."""

    def show_word(self, *args: Any) -> Any:
        """Show one word's map (see :class:`explain.explorer.web.App`)."""


def gradio() -> Any:
    """The ``gradio`` module, imported on first use, its analytics off (the app works offline)."""
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    try:
        import gradio as gr
    except ImportError:
        raise ExplainError('the app needs Gradio: pip install "explain[app]"') from None
    return gr


# Every torch call of the app runs on this one thread. PyTorch's OpenMP keeps a team of threads per thread that
# runs it; once the teams of the loading thread and of the server's worker threads outnumber the cores, they stop
# spinning between parallel regions, and a small model's forward runs at half its speed (measured on 2 cores).
_ON_MODEL_THREAD = threading.local()
_MODEL_THREAD = ThreadPoolExecutor(
    max_workers=1, thread_name_prefix="explain-model", initializer=lambda: setattr(_ON_MODEL_THREAD, "active", True)
)


def on_model_thread(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run on the app's model thread, in the caller's context (where Gradio finds its page's warnings);
    called there already (one handler calling another), it runs in place."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if getattr(_ON_MODEL_THREAD, "active", False):
            return fn(*args, **kwargs)
        return _MODEL_THREAD.submit(contextvars.copy_context().run, fn, *args, **kwargs).result()

    return run


def user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A page's handler: run on the model thread, an :class:`ExplainError` shown in the page as its one line,
    never a traceback."""
    on_thread = on_model_thread(fn)

    @functools.wraps(fn)
    def shown(*args: Any) -> Any:
        try:
            return on_thread(*args)
        except ExplainError as err:
            raise gradio().Error(str(err), print_exception=False) from None

    return shown


