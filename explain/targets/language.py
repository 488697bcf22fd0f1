"""Targets of a language model's output: the tokens of an answer, each scored by its log-probability given the
image, the prompt and the answer before it (teacher forcing: one forward over the whole sequence)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from ..errors import TargetError
from .base import BoundTarget, OutputPicker, Target


class TokenTarget(Target):
    r"""Tokens of the sequence a causal language model reads, as targets.

    The score of the token :math:`y_p` at position :math:`p` is its log-probability given everything before it,
    :math:`\log \mathrm{softmax}(z_{p-1})_{y_p}`, where :math:`z_{p-1}` are the output's logits at position
    :math:`p - 1` (the model predicts position :math:`p` there), or with ``score="logit"`` the logit itself,
    :math:`z_{p-1, y_p}` (what a relevance propagation explains). One forward over the whole sequence scores every
    token at once; the probabilities reported are the tokens' either way.

    Args:
        tokens: The token ids of the sequence the model reads (prompt and answer), (T,) or (1, T).
        positions: Where the explained tokens are in it (each at least 1).
        combine: ``"each"``: one map per token, the K axis in their order (a token by token strip); ``"sum"``: one
            map of their summed log-probabilities (the whole answer, or a span of words); or the lengths of
            consecutive runs of the positions, one map per run of its summed log-probabilities (a word of several
            tokens is one run).
        score: What is differentiated: the token's ``"log_probability"`` or its ``"logit"``.
        output: See :class:`Target` (default: the output's ``logits``).

    Raises:
        TargetError: No position, or a position outside the sequence or at its first token, or an unknown score.
    """

    def __init__(
        self,
        tokens: Tensor | Sequence[int],
        positions: Sequence[int],
        combine: Literal["each", "sum"] | Sequence[int] = "each",
        *,
        score: Literal["log_probability", "logit"] = "log_probability",
        output: OutputPicker = None,
    ) -> None:
        super().__init__(output)
        if score not in ("log_probability", "logit"):
            raise TargetError(f"score must be 'log_probability' or 'logit', got {score!r}")
        self.score, self.combine = score, combine
        self.tokens = torch.as_tensor(tokens).reshape(-1)
        self.positions = [int(p) for p in positions]
        runs = (
            {"each": [1] * len(self.positions), "sum": [len(self.positions)]}.get(combine)
            if isinstance(combine, str)
            else [int(n) for n in combine]
        )
        if runs is None or sum(runs) != len(self.positions) or min(runs, default=0) < 1:
            raise TargetError(
                f"combine must be 'each', 'sum' or run lengths (each at least 1) adding up to the "
                f"{len(self.positions)} positions, got {combine!r}"
            )
        if not self.positions or not all(1 <= p < len(self.tokens) for p in self.positions):
            raise TargetError(
                f"positions {self.positions} must be at least one, each from 1 to {len(self.tokens) - 1}: a token is "
                "scored by the logits before it, so the sequence's first token has no score"
            )
        self.runs = torch.repeat_interleave(torch.arange(len(runs)), torch.tensor(runs))  # each position's run
        self.keeps_k = combine != "sum"

    def from_logits(self) -> TokenTarget:
        return TokenTarget(self.tokens, self.positions, self.combine, score="logit", output=self.output)

    def log_probabilities(self, output: Any, logits_only: bool = False) -> Tensor:
        """Each explained token's log-probability in every row of an output (rows, K), K tokens; or its logit."""
        logits = self.read(output)
        if logits.dim() != 3 or logits.shape[1] != len(self.tokens):
            raise TargetError(
                f"the model's logits are {tuple(logits.shape)}, not (N, {len(self.tokens)}, vocabulary) over the "
                f"{len(self.tokens)} tokens the target scores: give the target the sequence the model reads"
            )
        before = torch.tensor([p - 1 for p in self.positions], device=logits.device)
        tokens = self.tokens.to(logits.device)[torch.tensor(self.positions, device=logits.device)]
        read = logits[:, before].float()  # (rows, K, vocabulary)
        read = read if logits_only else read.log_softmax(dim=-1)
        return read.gather(2, tokens.view(1, -1, 1).expand(len(read), -1, 1))[..., 0]

    def bind(self, output: Any, labels: Sequence[str] | None) -> BoundTarget:
        def summed(values: Tensor) -> Tensor:
            runs = self.runs.to(values.device)
            return values.new_zeros(len(values), int(self.runs[-1]) + 1).index_add(1, runs, values)

        def score(out: Any, images: Tensor) -> Tensor:
            return summed(self.log_probabilities(out, logits_only=self.score == "logit"))

        probabilities = summed(self.log_probabilities(output)).detach().exp()
        return BoundTarget(score=score, probabilities=probabilities, keeps_k=self.keeps_k)
