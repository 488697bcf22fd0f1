"""Shorthand for targets: an int, a class name, a sequence, a callable or None, as the target object it stands
for."""

from __future__ import annotations

from ..errors import TargetError
from .base import BoundTarget, CallableTarget, Target, TargetLike
from .classification import ClassTarget, TopK


def as_target(target: TargetLike, topk: int | None = None) -> Target | BoundTarget:
    """The target object for a target or its shorthand.

    ``None`` is each image's top-1 class; an int or name one class for all images; a
    sequence or 1-D tensor one class per image; a callable one score per row; and
    ``topk=K`` is :class:`TopK`. A target bound already (a result's ``target``) is returned as it is.

    Raises:
        TargetError: ``topk`` together with a target.
    """
    if topk is not None:
        if target is not None:
            kind = "a callable target" if callable(target) and not isinstance(target, Target) else "a target"
            raise TargetError(f"topk explains the top classes; it cannot be combined with {kind}")
        return TopK(topk)
    if isinstance(target, Target):
        return target
    if isinstance(target, BoundTarget):
        return target
    if callable(target):
        return CallableTarget(target)
    return ClassTarget(target)
