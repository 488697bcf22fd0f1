"""The export's model step for a vision-language model: each image's words (its answer's, its text prompts, or the
boxes an open-vocabulary detector finds for its text queries, as its task has them), each word a target of the
export's records with its map, written as every other model's maps are (:mod:`explain.export.run`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image

from ..errors import ExplainError, LayerError, NothingToExplain, first_line
from ..models.text_image import TextImageSpec
from ..tasks.language import Word, WordsRequest, WordsTask
from .outputs import Explained, Explanation, Failure, NothingFound, Outcome
from .settings import ExportOptions


class WordsExplainer:
    """The model step of a vision-language model: explains each image of a group, one at a time (the model reads
    each at its own size)."""

    def __init__(self, spec: TextImageSpec, options: ExportOptions, device: torch.device, task: WordsTask) -> None:
        self.spec, self.task, self.options, self.device = spec, task, options, device
        (method,) = options.methods.names  # the task gives one method at a time
        chosen = options.methods.options_for(method, options.batch_size)
        self.request: WordsRequest = task.request(options.asked, method, options.layer, chosen)

    def outcomes(self, x: torch.Tensor, images: Sequence[np.ndarray]) -> list[Outcome]:
        """Each image's words as targets, or its failure; a wrong layer stops the run."""
        return [self.explained(Image.fromarray(pixels)) for pixels in images]

    def explained(self, image: Image.Image) -> Outcome:
        """One image's words as targets, its maps of them all as its raw maps."""
        try:
            words, said = self.task.words(self.spec, image, self.request)
        except NothingToExplain as err:  # no box above the threshold: nothing to draw, and no failure
            return NothingFound(f"nothing to explain: {err.reason}")
        except LayerError:
            raise
        except (ExplainError, RuntimeError, AssertionError) as err:  # the model's own refusal of the image too
            return Failure(first_line(err))
        method = self.request.method
        targets = [_target(k, word, method) for k, word in enumerate(words)]
        raw = torch.stack([word.cam for word in words]).float().numpy().astype(np.float32)  # (words, H, W)
        return Explanation(targets, {method: raw}, {method: said["layer"]}, said.get("answer"))


def _target(k: int, word: Word, method: str) -> Explained:
    """A word as the export's target: its place, its text as its name, its score, and its box where it has one."""
    return Explained(k, {method: word.cam}, k, word.text, word.score, word.box, None)
