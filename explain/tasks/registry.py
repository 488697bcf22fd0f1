"""Which task a model's output is: :func:`task_of`, from what its spec says and what the user asked. The one
place where a kind of output is known by its name."""

from __future__ import annotations

from ..errors import ExplainError
from ..models import ModelSpec
from ..models.text_image import TextImageSpec
from .base import Task
from .images import Classification, DepthRegion, Detection, Keypoints, OrientedBoxes, PromptedMask, Segmentation
from .language import Answers, Prompts, Queries, WordsTask

# The tasks of a ModelSpec's ``task`` (its default target's kind), and of a TextImageSpec's ``kind``.
TASKS: dict[str, type[Task]] = {
    "classification": Classification,
    "segmentation": Segmentation,
    "detection": Detection,
    "depth": DepthRegion,
    "prompted": PromptedMask,
}
TEXT_TASKS: dict[str, type[WordsTask]] = {"answers": Answers, "scores": Prompts, "detects": Queries}


def task_of(spec: ModelSpec | TextImageSpec, keypoint: str | None = None) -> Task:
    """The task of a model: its spec's, a detector's refined by what it finds (oriented boxes, where the model
    says so; a pose model's keypoints, where ``keypoint`` is asked); a vision-language model's from its kind.

    Raises:
        ExplainError: A spec whose task is none of :data:`TASKS`.
    """
    if isinstance(spec, TextImageSpec):
        return words_task_of(spec)
    kind = TASKS.get(spec.task)
    if kind is None:
        raise ExplainError(f"{spec.name}: unknown task {spec.task!r}; a ModelSpec's task is one of {', '.join(TASKS)}")
    if kind is Detection and keypoint is not None:
        return Keypoints()
    if kind is Detection and getattr(spec.model, "oriented", False):
        return OrientedBoxes()
    return kind()


def words_task_of(spec: TextImageSpec) -> WordsTask:
    """The task of a vision-language model, from its kind."""
    return TEXT_TASKS[spec.kind]()
