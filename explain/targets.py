"""Turn the caller's ``target`` into the scores whose gradients are explained."""

from __future__ import annotations

import difflib
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from .errors import TargetError

Target = int | str | Sequence[int | str] | Tensor | Callable[[Any], Tensor] | None


def class_index(target: int | str | Tensor, labels: Sequence[str] | None, num_classes: int) -> int:
    """Resolve a class index or class name to an index checked against ``num_classes``.

    Names match exactly first, then case-insensitively.

    Raises:
        TargetError: The name is unknown (close names are suggested), no labels are
            known to resolve it, or the index is out of range.
    """
    if isinstance(target, str):
        if labels is None:
            raise TargetError(f"target {target!r} is a class name, but the model's labels are unknown; pass labels=")
        if target in labels:
            return list(labels).index(target)
        folded = [name.casefold() for name in labels]
        if target.casefold() in folded:
            return folded.index(target.casefold())
        close = difflib.get_close_matches(target, list(labels), n=5, cutoff=0.6)
        hint = f"; did you mean: {', '.join(close)}" if close else ""
        raise TargetError(f"unknown class name {target!r}{hint}")
    index = int(target)
    if not 0 <= index < num_classes:
        raise TargetError(f"class index {index} is out of range for a model with {num_classes} classes")
    return index


def select_scores(
    output: Any,
    target: Target,
    labels: Sequence[str] | None = None,
    topk: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Pick the scores to explain from the model output.

    Args:
        output: The model output: (N, num_classes) scores, or anything a callable
            target can read (a tuple, a dict, an object with ``.logits``).
        target: None (top-1 per image), a class index or name for every image, a
            sequence of indices or names, or a tensor of indices (one per image), or a callable mapping
            the model output to one score per image.
        labels: Class names, to resolve a name.
        topk: Explain each image's K highest-scoring classes (only with ``target=None``).

    Returns:
        ``(scores, indices)``: scores (N, K) to differentiate, and their class
        indices (N, K), or None for a callable target. K is 1 unless ``topk`` is set.
    """
    if callable(target):
        if topk is not None:
            raise TargetError("topk cannot be combined with a callable target")
        scores = target(output)
        if not isinstance(scores, Tensor) or scores.dim() != 1:
            raise TargetError("a callable target must return a tensor of one score per image, shape (N,)")
        return scores[:, None], None
    if not isinstance(output, Tensor) or output.dim() != 2:
        found = tuple(output.shape) if isinstance(output, Tensor) else type(output).__name__
        raise TargetError(
            f"the model output is {found}, not a classifier's (N, classes) scores; pass a callable target"
        )
    logits = output
    n, num_classes = logits.shape
    if topk is not None:
        if target is not None:
            raise TargetError("topk explains the top classes; it cannot be combined with a target")
        if not 1 <= topk <= num_classes:
            raise TargetError(f"topk must be between 1 and {num_classes}")
        indices = logits.topk(topk, dim=1).indices
    elif target is None:
        indices = logits.argmax(dim=1, keepdim=True)
    elif isinstance(target, (str, numbers.Integral)) or (isinstance(target, Tensor) and target.dim() == 0):
        indices = torch.full((n, 1), class_index(target, labels, num_classes), device=logits.device)
    else:
        per_image = [class_index(t, labels, num_classes) for t in target]
        if len(per_image) != n:
            raise TargetError(f"{len(per_image)} targets given for a batch of {n} images")
        indices = torch.tensor(per_image, device=logits.device)[:, None]
    return logits.gather(1, indices), indices
