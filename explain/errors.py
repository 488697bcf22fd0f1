"""The errors `explain` raises for problems a user can fix."""

import re


class ExplainError(ValueError):
    """Base class: a problem with what the caller asked for, stated in one line."""


class LayerError(ExplainError):
    """The target layer is unknown or cannot give a class activation map."""


class TargetError(ExplainError):
    """The requested target class or score cannot be resolved."""


class ImageRefused(TargetError):
    """The target cannot be placed on an image: a region outside it. An export fails that image alone.

    Args:
        reason: What is wrong, in a few words (the export's error for the image).
        image: The image of the batch it concerns, or None for every image.
        hint: What to do about it, appended to the message.
    """

    def __init__(self, reason: str, image: int | None = None, hint: str = "") -> None:
        self.reason = reason
        where = "" if image is None else f"image {image}: "
        super().__init__(where + reason + (f"; {hint}" if hint else ""))


class NothingToExplain(ImageRefused):
    """An image holds nothing the target asks for: no detection above the threshold, no pixel of the class. An
    export notes it for that image, without a failure."""


class ModelLoadError(ExplainError):
    """A model or its weights cannot be loaded."""


class InputLoadError(ExplainError):
    """An input file cannot be read: an image, a volume or a signal."""


class ImageLoadError(InputLoadError):
    """An input file cannot be read as an image."""


def first_line(err: BaseException) -> str:
    """An exception's message as one line (its first, without terminal colour codes), or its type's name."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(err)).strip()
    return text.splitlines()[0] if text else type(err).__name__
