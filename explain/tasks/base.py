"""The kind of output a model gives, as one object that every front end asks: :class:`Task`.

A task says which of the options that belong to some kinds only it takes (checked once, refused in one line),
the target built from what the user asked, what one map is of, how its files are named, what its overlay draws,
what a click on the photo means in the explorer, and what ``explain evaluate`` explains of an image. The command
line, the export, the explorer, the notebook and ``explain evaluate`` ask it; none of them tests a kind's name.
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import Tensor, nn

from ..errors import ExplainError
from ..models import ModelSpec
from ..models.text_image import TextImageSpec
from ..targets import Target
from .asked import Asked, Prompt, refuse_untaken


class Task:
    """One kind of output. Subclasses set the class attributes and :meth:`target`; the rest has defaults.

    Attributes:
        name: The kind's name, as a :class:`explain.ModelSpec`'s ``task`` says it.
        called: What the refusals call a model of the kind (``"<model> is a <called> model"``): its name, unless
            set.
        map_of: What one map is of ("class", "segment", "box", "keypoint", "region", "mask", "word", ...).
        takes: The options of :data:`explain.tasks.asked.OPTIONS` it takes; any other given is refused.
        classifies: Whether a map is of one of the model's ranked classes: its top classes are listed, a view
            names a class, and the metrics of a class's probability apply.
        click: What a click on the photo does in the explorer: ``""`` (nothing: a classifier's classes have no
            place, they are picked from a list), ``"pick"`` (the entry under it), ``"prompt"`` (a point, or two
            corners of a box, prompt the model) or ``"region"`` (two corners of the region).
        click_label: What the explorer says a click does.
        strip: Where ``--figure`` draws strips of maps rather than a figure per map, each strip's part of its
            file name, ``{n}`` its number (``"det{n}.keypoints"``: a strip per detection); empty: no strips.
        strip_title: Each strip's title, ``{n}`` its number.
        one_method: Whether a run gives it one method at a time.
        evaluates: Whether ``explain evaluate`` scores its maps (it has one thing to explain per image).
    """

    name: ClassVar[str]
    called: ClassVar[str | None] = None
    map_of: ClassVar[str]
    takes: ClassVar[frozenset[str]] = frozenset()
    classifies: ClassVar[bool] = False
    click: ClassVar[str] = "pick"
    click_label: ClassVar[str] = ""
    strip: ClassVar[str] = ""
    strip_title: ClassVar[str] = ""
    one_method: ClassVar[bool] = False
    evaluates: ClassVar[bool] = False

    @property
    def strips(self) -> bool:
        """Whether ``--figure`` draws strips of maps rather than a figure per map."""
        return bool(self.strip)

    def strip_runs(self, explained: list[Any]) -> list[list[Any]]:
        """The maps of an image that each strip draws: a detection's, whose maps share its box, in order."""
        runs: list[list[Any]] = []
        for e in explained:
            if runs and runs[-1][0].box == e.box:
                runs[-1].append(e)
            else:
                runs.append([e])
        return runs

    @property
    def picks(self) -> bool:
        """Whether a click on the photo picks one of its entries (a box, a segment, a keypoint)."""
        return self.click == "pick"

    @property
    def prompted(self) -> bool:
        """Whether a click on the photo prompts the model or draws its region: a view's prompt is for it."""
        return self.prompts or self.regions

    @property
    def prompts(self) -> bool:
        """Whether a click prompts the model (a point, or two corners of a box): nothing is explained before."""
        return self.click == "prompt"

    @property
    def regions(self) -> bool:
        """Whether two clicks draw the region whose output is explained (a depth model's)."""
        return self.click == "region"

    @property
    def words(self) -> bool:
        """Whether its maps are of words (a vision-language model's): the explorer shows its words' page."""
        return self.click == "word"

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def check(self, spec: ModelSpec | TextImageSpec, asked: Asked) -> None:
        """Refuse, in one line, an option the task does not take or a prompt it cannot use.

        Raises:
            ExplainError: Naming the option, what it is for, and the model.
        """
        refuse_untaken(asked, self.takes, spec.name, self.called or self.name)
        asked.prompt.check()

    def target(self, spec: ModelSpec, asked: Asked) -> Target:
        """What the model's maps explain, from what the user asked."""
        raise NotImplementedError

    def explained(self, spec: ModelSpec, prompt: Prompt) -> ModelSpec:
        """The model whose maps are made: the spec as it is, or (a promptable segmenter) given its prompt."""
        return spec

    def tag(self, k: int, class_name: str, method: str, topk: int | None) -> str:
        """What tells one image's outputs apart: the method, and which of its maps."""
        raise NotImplementedError

    def check_evaluated(self, spec: ModelSpec | TextImageSpec) -> None:
        """Refuse, in one line, a model of a task that ``explain evaluate`` cannot score.

        Raises:
            ExplainError: The task has no one thing to explain per image.
        """
        if not self.evaluates:
            raise ExplainError(
                f"explain evaluate scores maps of a classifier's class, a detector's box or a segmenter's class; "
                f"{spec.name} is a {self.called or self.name} model"
            )

    def evaluated(self, spec: ModelSpec, name: str, x: Tensor) -> Target | None:
        """What ``explain evaluate`` explains in an image: None for the task's default target.

        Raises:
            ExplainError: The task has no one thing to explain per image, or the image holds none.
        """
        self.check_evaluated(spec)
        return None

    def probe_prompt(self, size: tuple[int, int]) -> tuple[float, ...]:
        """A prompt under which the explorer looks at the model's layers on a photo of (width, height): none, for
        a task whose model needs none."""
        return ()

    def view(self, spec: ModelSpec, prompt: tuple[float, ...], size: tuple[int, int], asked: Asked) -> Viewed:
        """What the explorer's view of a photo explains: the model and the target, from the view's prompt (the
        photo's pixels) and the photo's (width, height).

        Raises:
            ExplainError: A prompt the task takes none of, or of the wrong length.
        """
        if prompt:
            raise ExplainError(f"{spec.name} is a {self.name} model: a click picks one of its entries, not a prompt")
        return spec.model, self.target(spec, asked)


Viewed = tuple[nn.Module, Target]
