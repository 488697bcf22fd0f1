"""The errors `explain` raises for problems a user can fix."""

import re


class ExplainError(ValueError):
    """Base class: a problem with what the caller asked for, stated in one line."""


class LayerError(ExplainError):
    """The target layer is unknown or cannot give a class activation map."""


class TargetError(ExplainError):
    """The requested target class or score cannot be resolved."""


class ModelLoadError(ExplainError):
    """A model or its weights cannot be loaded."""


class ImageLoadError(ExplainError):
    """An input file cannot be read as an image."""


def first_line(err: BaseException) -> str:
    """An exception's message as one line (its first, without terminal colour codes), or its type's name."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(err)).strip()
    return text.splitlines()[0] if text else type(err).__name__
