"""LeGrad: each transformer block's own read-out of the class, differentiated at that block's attention."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import Tensor, nn

from ..core.attention_capture import AttentionRecorder
from ..core.engine import Capture, Needs
from ..core.layers import LayerSpec
from ..core.recording import AttentionProbabilities, layer_label
from ..errors import LayerError
from .rollout import Rollout, class_head

ReadOut = Callable[[Tensor], Any]  # a block's tokens (N, T, C) -> an output the target scores


def read_out_of(model: nn.Module) -> ReadOut | None:
    """How a vision transformer reads its class out of any block's tokens: the tokens' mean through the model's
    final norm and head (:func:`explain.methods.rollout.class_head`); None for another model."""
    head = class_head(model)
    return None if head is None else lambda tokens: head(tokens.mean(dim=1))


class ReadOutRecorder(AttentionRecorder):
    """An attention recorder that also reads the class out of each attention's block (its parent module), so
    that each block's read-out can be differentiated at its own attention.

    Attributes:
        read_outs: Each block's read-out of the last forward, in the attention modules' order.
    """

    def __init__(self, modules: Mapping[str, nn.Module], name: str, blocks: Sequence[nn.Module], read_out: ReadOut):
        super().__init__(modules, name)
        self.blocks, self.read_out = list(blocks), read_out
        self.read_outs: list[Any] = []

    def __enter__(self) -> ReadOutRecorder:
        super().__enter__()
        for index, block in enumerate(self.blocks):
            self._hooks.forward(block, lambda m, i, o, index=index: self._read(index, o))
        return self

    def _read(self, index: int, output: Any) -> None:
        tokens = output if isinstance(output, Tensor) else output[0]
        self.read_outs[index] = self.read_out(tokens)

    def forward(self, model: Callable[[Tensor], Any], x: Tensor) -> Any:
        self.read_outs = [None] * len(self.blocks)
        return super().forward(model, x)

    def backward(
        self, score: Tensor, create_graph: bool = False, rescore: Callable[[Any], Tensor] | None = None
    ) -> dict[str, Tensor]:
        """Each attention's gradient of its own block's read-out, scored by ``rescore`` as the pass's target."""
        if rescore is None or create_graph:
            raise LayerError("LeGrad differentiates each block's read-out, scored as the target, once")
        return self.backward_each([rescore(read) for read in self.read_outs])


class BlockReadOuts(AttentionProbabilities):
    """The attention probabilities, with each block's read-out of the class (:class:`ReadOutRecorder`), each
    differentiated at its own block's attention."""

    def recorder(self, method: LeGrad, modules: Mapping[str, nn.Module]) -> ReadOutRecorder:  # type: ignore[override]
        read_out = method.read_out
        if read_out is None:
            raise LayerError(
                f"LeGrad reads the class out of each block through the model's final norm and head; for a "
                f"{type(method.model).__name__} give read_out=, a function of a block's tokens (N, T, C)"
            )
        chosen = self.chosen(method)
        blocks = [method.model.get_submodule(name.rpartition(".")[0]) for name in chosen]
        return ReadOutRecorder(chosen, layer_label(list(chosen)), blocks, read_out)


class LeGrad(Rollout):
    r"""LeGrad: Bousselham et al., "LeGrad: An Explainability Method for Vision Transformers via Feature Formation
    Sensitivity", 2024 (arXiv:2404.03214).

    Each block l reads the class out of its own tokens, :math:`s^l = \mathrm{head}(\mathrm{norm}(\bar z^l))` (the
    tokens' mean through the model's final norm and head, as the authors' code and torchcam's); the target's score
    of it is differentiated at that block's attention probabilities :math:`A^l`. The positive part of the gradient,
    averaged over heads and queries, gives each key token's weight; the patch tokens' weights, averaged over the
    blocks, are the map: :math:`\mathrm{mean}_l\, \mathrm{mean}_{h,q} (\partial s^l / \partial A^l)^+`. Class-specific
    through any target that scores the read-out.

    Args:
        model: A vision transformer whose attention can be read (torchvision's, timm's, HuggingFace's; see
            :mod:`explain.core.attention_capture`); left as it was.
        layer: The attention modules whose blocks are read out; None: all.
        labels: Class names, to accept a class name as target.
        read_out: How a block's tokens (N, T, C) become an output the target scores; None: the model's own norm
            and head (:func:`read_out_of`), which another model must give.
    """

    name = "legrad"
    title = "LeGrad, each block's read-out at its attention (Bousselham et al. 2024)"
    fast = False
    cost = "a backward per block"
    needs = Needs(whole_backward=True, records=BlockReadOuts())  # every block's read-out reads every token

    def __init__(
        self,
        model: nn.Module,
        layer: LayerSpec | Sequence[str | nn.Module] = None,
        *,
        labels: Sequence[str] | None = None,
        read_out: ReadOut | None = None,
    ) -> None:
        super().__init__(model, layer, labels=labels)
        self.read_out = read_out or read_out_of(model)

    def compute(self, capture: Capture) -> Tensor:
        grid, prefix = self.patch_grid(capture)
        keys = capture.gradients.clamp(min=0).mean(dim=(2, 3))  # (N, layers, T): over heads and queries
        return keys[..., prefix:].mean(dim=1).reshape(-1, *grid)
