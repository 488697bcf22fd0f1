"""What a user asks of a task, without torch: the options that belong to some kinds of output only, the prompt of a
dense model, and how outputs are named. The command line reads these before it loads a model."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ExplainError

DIRECTIONS = ("larger", "smaller", "nearer", "farther")
NEW_TOKENS = 16  # the longest answer generated, where --max-new-tokens is not given
DETECTION_THRESHOLD = 0.5  # a detector's least score of an explained detection, where none is given


@dataclass(frozen=True)
class Prompt:
    """Where a dense model's target lies: a depth estimator's region, a promptable segmenter's prompt; every
    coordinate in the photo's own pixels.

    Attributes:
        region: A depth estimator's region ``(x1, y1, x2, y2)``; None (and no ``region_mask``): the whole photo.
        region_mask: A mask image of the region (nonzero inside), resized to each photo.
        direction: What the region's mean depth is explained for: ``"larger"`` or ``"smaller"`` values, or
            ``"nearer"`` or ``"farther"`` (read from the model's config: see :func:`explain.targets.nearer_sign`).
        points: A promptable segmenter's points ``(x, y)`` on the object.
        box: A promptable segmenter's box ``(x1, y1, x2, y2)``.
    """

    region: tuple[float, float, float, float] | None = None
    region_mask: Path | None = None
    direction: str = "larger"
    points: tuple[tuple[float, float], ...] = ()
    box: tuple[float, float, float, float] | None = None

    def check(self) -> None:
        """Refuse a prompt that contradicts itself, whatever the model.

        Raises:
            ExplainError: Naming the option.
        """
        if self.region is not None and self.region_mask is not None:
            raise ExplainError("give the region as --region or as --region-mask, not both")
        if self.direction not in DIRECTIONS:
            raise ExplainError(f"--direction must be larger, smaller, nearer or farther, got {self.direction!r}")

    @property
    def regional(self) -> bool:
        """Whether a depth estimator's region or direction is given."""
        return self.region is not None or self.region_mask is not None or self.direction != "larger"

    @property
    def prompting(self) -> bool:
        """Whether a promptable segmenter's point or box is given."""
        return bool(self.points) or self.box is not None


def texts_of(text: str) -> tuple[str, ...]:
    """Comma-separated text prompts or queries, as ``--text`` and the explorer take them: each stripped, the empty
    ones left out."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


@dataclass(frozen=True)
class Reading:
    """What a vision-language model reads besides the image.

    Attributes:
        question: The question to a model that answers (a prompt copied from a model card, with its image
            token, is read as written), or None.
        answer: The answer whose words are explained instead of the model's own, or None.
        texts: The text prompts of a contrastive model, or the text queries of an open-vocabulary detector.
        max_new_tokens: The longest answer generated; None: :data:`NEW_TOKENS`.
    """

    question: str | None = None
    answer: str | None = None
    texts: tuple[str, ...] = ()
    max_new_tokens: int | None = None

    @property
    def given(self) -> bool:
        """Whether anything is given for a vision-language model to read."""
        asked = (self.question, self.answer, self.max_new_tokens)
        return any(value is not None for value in asked) or bool(self.texts)

    @property
    def new_tokens(self) -> int:
        """The longest answer generated, as asked or by default."""
        return NEW_TOKENS if self.max_new_tokens is None else self.max_new_tokens

    def check(self) -> None:
        """Refuse a reading that contradicts itself, whatever the model.

        Raises:
            ExplainError: Naming the options.
        """
        if self.answer is not None and self.question is None:
            raise ExplainError("--answer explains an answer to a --prompt: give the prompt too")
        if self.texts and self.question is not None:
            raise ExplainError(
                "--prompt asks a model that answers, --text scores prompts with a contrastive one: give one"
            )
        if self.max_new_tokens is None:
            return
        if self.max_new_tokens < 1:
            raise ExplainError(f"--max-new-tokens must be at least 1, got {self.max_new_tokens}")
        if self.question is None or self.answer is not None:
            raise ExplainError(
                "--max-new-tokens bounds the answer a model generates for a --prompt; give the prompt, without --answer"
            )


@dataclass(frozen=True)
class Asked:
    """What is explained, as the user asked it; a task turns it into its target.

    Attributes:
        target: A class index or name, or None (each task's default).
        topk: A classifier's K top classes instead of one.
        score_threshold: The least score of an explained detection; None: the task's default
            (:data:`DETECTION_THRESHOLD`).
        keypoint: A pose model's keypoint (a name, an index, or ``"all"``), explained for each detection.
        prompt: A depth estimator's region or a promptable segmenter's prompt.
        metrics: The faithfulness metrics measured for each map.
        reading: What a vision-language model reads besides the image.
    """

    target: int | str | None = None
    topk: int | None = None
    score_threshold: float | None = None
    keypoint: str | None = None
    prompt: Prompt = field(default_factory=Prompt)
    metrics: tuple[str, ...] = ()
    reading: Reading = field(default_factory=Reading)


@dataclass(frozen=True)
class Option:
    """An option that some kinds of output take and others refuse.

    Attributes:
        given: Whether the user gave it.
        purpose: What it is for, as the refusal says it (``"--topk explains a classifier's top classes"``).
    """

    given: Callable[[Asked], bool]
    purpose: str


OPTIONS = {
    "topk": Option(lambda asked: asked.topk is not None, "--topk explains a classifier's top classes"),
    "metrics": Option(lambda asked: bool(asked.metrics), "--metrics explains a classifier's class"),
    "keypoint": Option(lambda asked: asked.keypoint is not None, "--keypoint explains a pose model's keypoints"),
    "score_threshold": Option(
        lambda asked: asked.score_threshold is not None, "--score-threshold sets a detector's least explained score"
    ),
    "region": Option(lambda asked: asked.prompt.regional, "--region explains a depth estimator's region"),
    "prompt": Option(lambda asked: asked.prompt.prompting, "--point and --box prompt a promptable segmenter (SAM)"),
    "reading": Option(
        lambda asked: asked.reading.given, "--prompt, --answer and --text are read by a vision-language model"
    ),
}


def slug(name: str) -> str:
    """A class name as part of a file name: lower case, runs of other characters than letters and digits as '-'."""
    return "-".join("".join(c if c.isalnum() else " " for c in name.lower()).split()) or "class"


def refuse_untaken(asked: Asked, takes: frozenset[str], model: str, kind: str) -> None:
    """Refuse, in one line, the first option given that a kind of output does not take.

    Raises:
        ExplainError: ``"<what the option is for>; <model> is a <kind> model"``.
    """
    for name, option in OPTIONS.items():
        if name not in takes and option.given(asked):
            raise ExplainError(f"{option.purpose}; {model} is a {kind} model")
