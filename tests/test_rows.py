"""Backward passes at the rows a score reaches (explain.rows): the gradients plain autograd gives, with the
rows a score does not reach left out of the recomputation."""

from __future__ import annotations

import pytest
import timm
import torch
from torch import nn

import explain
from explain.rows import positionwise_rows


class Branching(nn.Module):
    """norm -> linear -> GELU -> linear on a sequence, the first linear's output also read by a second branch."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.act, self.down = nn.LayerNorm(6), nn.Linear(6, 12), nn.GELU(), nn.Linear(12, 6)
        self.side = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.up(self.norm(x))
        return self.down(self.act(hidden)), self.side(hidden)


def gradient(model: nn.Module, x: torch.Tensor, read, sparse: bool) -> torch.Tensor:
    """d read(model(x)) / dx, with the parameters frozen, with or without the position-wise rows context."""
    model.requires_grad_(False)
    x = x.clone().requires_grad_(True)
    with positionwise_rows(model) if sparse else torch.enable_grad():
        score = read(*model(x))
    return torch.autograd.grad(score, x)[0]


@pytest.mark.parametrize(
    "read",
    [
        lambda main, side: main[:, 0].pow(2).sum(),  # one row per sequence: recomputed
        lambda main, side: main[0, 2].sum() + side[1, 4].sum(),  # rows reached by both branches: recomputed
        lambda main, side: main.pow(2).sum() + side[:, 0].sum(),  # every row: through the recorded graph
    ],
    ids=["first-rows", "both-branches", "all-rows"],
)
def test_gradients_equal_plain_autograd(read) -> None:
    torch.manual_seed(0)
    model, x = Branching(), torch.randn(2, 5, 6)
    expected = gradient(model, x, read, sparse=False)
    assert expected.abs().max() > 0
    torch.testing.assert_close(gradient(model, x, read, sparse=True), expected, rtol=1e-5, atol=1e-6)


def spy_rows(module: nn.Module, seen: list[int]) -> None:
    """Record the number of rows each call of ``module.forward`` sees, direct calls included (an instance
    attribute shadows the class's forward for both)."""
    forward = module.forward

    def spied(x: torch.Tensor) -> torch.Tensor:
        seen.append(x.reshape(-1, x.shape[-1]).shape[0])
        return forward(x)

    module.forward = spied


def test_only_the_reached_rows_are_recomputed_and_only_position_wise_layers_are_joined() -> None:
    torch.manual_seed(0)
    model = Branching()
    seen: dict[str, list[int]] = {name: [] for name in ("up", "down", "side")}
    for name, rows in seen.items():
        spy_rows(getattr(model, name), rows)
    gradient(model, torch.randn(2, 5, 6), lambda main, side: main[:, 0].sum(), sparse=True)
    assert seen == {"up": [10, 2], "down": [10, 2], "side": [10]}  # the forward's 2x5 rows, then the 2 reached

    class Norm2d(nn.LayerNorm):  # normalizes channels first: not a layer of the last axis
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x.transpose(1, 2)).transpose(1, 2)

    for layer, joined in ((nn.Linear(6, 6), True), (Norm2d(5), False), (nn.ReLU(inplace=True), False)):
        with positionwise_rows(layer.requires_grad_(False)):
            out = layer(torch.randn(2, 5, 6, requires_grad=True) * 1)
        assert joined == any("RowsRecomputed" in type(node).__name__ for node, _ in out.grad_fn.next_functions)


def test_layers_whose_weight_gradient_is_wanted_are_left_alone() -> None:
    torch.manual_seed(0)
    model, x = Branching(), torch.randn(2, 5, 6)
    grads = []
    for sparse in (False, True):
        model.zero_grad(set_to_none=True)
        with positionwise_rows(model) if sparse else torch.enable_grad():
            main = model(x.clone().requires_grad_(True))[0]
        main[:, 0].sum().backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert len(grads[1]) == len(grads[0]) > 0
    for sparse_grad, plain in zip(*reversed(grads)):
        torch.testing.assert_close(sparse_grad, plain)


def test_class_token_vit_differentiates_its_last_mlp_at_the_class_token_alone() -> None:
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", num_classes=10, img_size=64).eval()
    seen: list[int] = []
    spy_rows(model.blocks[-1].mlp.fc1, seen)
    x = torch.randn(3, 3, 64, 64)
    explain.GradCAM(model, "blocks.11.norm1")(x)
    assert seen == [3 * 17, 3]  # 16 patches and the class token per image forward, the class tokens backward
