"""Backward passes at the rows a score reaches (explain.core.speedups.rows): the gradients plain autograd gives,
with the
rows a score does not reach left out of the recomputation."""

from __future__ import annotations

import pytest
import timm
import torch
import torchvision
from torch import nn

import explain
from explain.core.layers import traced_layers
from explain.core.speedups.rows import reached_rows


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
    with reached_rows(model) if sparse else torch.enable_grad():
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
        with reached_rows(layer.requires_grad_(False)):
            out = layer(torch.randn(2, 5, 6, requires_grad=True) * 1)
        assert joined == ("RowsRecomputed" in type(out.grad_fn).__name__)  # the joined output, no view of it


def test_layers_whose_weight_gradient_is_wanted_are_left_alone() -> None:
    torch.manual_seed(0)
    model, x = Branching(), torch.randn(2, 5, 6)
    grads = []
    for sparse in (False, True):
        model.zero_grad(set_to_none=True)
        with reached_rows(model) if sparse else torch.enable_grad():
            main = model(x.clone().requires_grad_(True))[0]
        main[:, 0].sum().backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert len(grads[1]) == len(grads[0]) > 0
    for sparse_grad, plain in zip(*reversed(grads)):
        torch.testing.assert_close(sparse_grad, plain)


@pytest.mark.parametrize("source", ["timm", "torchvision"])
def test_class_token_vit_differentiates_its_last_block_at_the_class_token_alone(source, monkeypatch) -> None:
    torch.manual_seed(0)
    if source == "timm":
        model = timm.create_model("vit_tiny_patch16_224", num_classes=10, img_size=64).eval()
        layer, fc1 = "blocks.11.norm1", model.blocks[-1].mlp.fc1
    else:
        model = torchvision.models.VisionTransformer(
            64, 16, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32
        ).eval()
        nn.init.normal_(model.heads.head.weight)  # torchvision starts it at zero
        layer, fc1 = "encoder.layers.encoder_layer_1.ln_1", model.encoder.layers[-1].mlp[0]
    seen: list[int] = []
    spy_rows(fc1, seen)
    attended: list[list[int]] = []
    recompute = explain.core.speedups.rows._attention_rows
    monkeypatch.setattr(
        explain.core.speedups.rows,
        "_attention_rows",
        lambda m, x, rows: attended.append(rows.tolist()) or recompute(m, x, rows),
    )
    x = torch.randn(3, 3, 64, 64)
    traced_layers(model, x)  # the layouts' trace (one-image forwards, once per input shape) is not counted here
    seen.clear()
    cams = explain.GradCAM(model, layer)(x).cams
    assert seen == [3 * 17, 3]  # 16 patches and the class token per image forward, the class tokens backward
    assert attended == [[0, 17, 34]]  # the last attention recomputed at the class tokens alone
    monkeypatch.setattr(explain.core.families, "reached_rows", lambda model, skip, sequences: torch.enable_grad())
    torch.testing.assert_close(cams, explain.GradCAM(model, layer)(x).cams, rtol=1e-4, atol=1e-5)


class Attending(nn.Module):
    """A self-attention on a sequence, then a linear layer: the output (and a second copy, for ``gradient``).
    timm's ``Attention`` with the given options, or with ``torch=True`` an ``nn.MultiheadAttention`` called as
    torchvision's ViT calls it."""

    def __init__(self, torch: bool = False, normed: bool = False, **options) -> None:
        super().__init__()
        from timm.models.vision_transformer import Attention

        self.norm = nn.LayerNorm(16) if normed else nn.Identity()  # a block's norm before its attention

        if torch:
            self.attn = nn.MultiheadAttention(16, 4, batch_first=True, **options)
        else:
            self.attn = Attention(16, num_heads=4, **options)
        self.out = nn.Linear(16, 3)

    def attend(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        x = self.norm(x)
        if isinstance(self.attn, nn.MultiheadAttention):
            return self.attn(x, x, x, **{"need_weights": False, **kwargs})[0]
        return self.attn(x, **kwargs)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.out(self.attend(x))
        return y, y


def joined_to_input(output: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether ``output`` (under a view) is joined by RowsRecomputed straight to the leaf ``x``."""
    node = output.grad_fn
    while "View" in type(node).__name__:
        node = node.next_functions[0][0]
    leaves = [getattr(n, "variable", None) for n, _ in node.next_functions if n is not None]
    return "RowsRecomputed" in type(node).__name__ and any(leaf is x for leaf in leaves)


@pytest.mark.parametrize(
    "read",
    [
        lambda y, _: y[:, 0].pow(2).sum(),  # the first row of each image: recomputed
        lambda y, _: y[0, 1].sum() + y[0, 4, 2] + y[2, 3].sum(),  # 2, 0 and 1 rows: padded to 2 per image
        lambda y, _: y.pow(2).sum(),  # every row: through the recorded graph
    ],
    ids=["first-rows", "uneven-rows", "all-rows"],
)
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"qkv_bias": True, "gated": True},
        {"qkv_bias": True, "scale_norm": True, "norm_layer": nn.LayerNorm},
        {"torch": True},
        {"torch": True, "bias": False},
        {"normed": True},
        {"torch": True, "normed": True},
    ],
    # a gate or a norm after the heads makes the value bias matter; a norm before the attention joins its input
    ids=[
        "timm",
        "timm-bias-gated",
        "timm-bias-normed",
        "torch",
        "torch-no-bias",
        "timm-after-norm",
        "torch-after-norm",
    ],
)
def test_attention_gradients_equal_plain_autograd(read, options) -> None:
    torch.manual_seed(0)
    model, x = Attending(**options), torch.randn(3, 7, 16)
    for name, p in model.named_parameters():  # zero-initialised biases would hide a misplaced one
        if name.endswith("bias"):
            nn.init.normal_(p)
    expected = gradient(model, x, read, sparse=False)
    assert expected.abs().max() > 0
    torch.testing.assert_close(gradient(model, x, read, sparse=True), expected, rtol=1e-4, atol=1e-6)


def test_attention_is_joined_only_where_its_recomputation_holds() -> None:
    """Key norms (logits no longer linear in the input), a mask, per-head weights asked for, or a recorder's hook
    inside: left as it is."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 16, requires_grad=True)
    mask = {"attn_mask": torch.ones(5, 5, dtype=torch.bool)}
    timm_attention, torch_attention = Attending(), Attending(torch=True)
    cases = [
        (timm_attention, {}, (), True),
        (torch_attention, {}, (), True),
        (Attending(qk_norm=True, norm_layer=nn.LayerNorm), {}, (), False),
        (Attending(torch=True, add_bias_kv=True), {}, (), False),
        (timm_attention, mask, (), False),
        (torch_attention, mask, (), False),
        (torch_attention, {"need_weights": True}, (), False),
        (timm_attention, {}, [timm_attention.attn.qkv], False),
        (timm_attention, {}, [timm_attention.attn], False),
    ]
    for model, kwargs, skip, joined in cases:
        model.requires_grad_(False)
        with reached_rows(model, skip=skip):
            out = model.attend(x, **kwargs)
        assert joined_to_input(out, x) == joined


@pytest.mark.parametrize("method", ["saliency", "input_x_gradient", "fullgrad"])
def test_input_gradient_methods_on_a_timm_vit_equal_plain_autograd(method, monkeypatch) -> None:
    """At 224 pixels (197 tokens) a timm ViT's attentions take the graph their forward recorded, reaching past the
    block's norm to the block's input: the input's gradient is autograd's (these methods crashed there)."""
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", num_classes=10, depth=2).eval()
    x = torch.randn(2, 3, 224, 224)
    raw = explain.METHODS[method](model)(x).raw
    monkeypatch.setattr(explain.core.families, "reached_rows", lambda model, skip, sequences: torch.enable_grad())
    expected = explain.METHODS[method](model)(x).raw
    assert torch.isfinite(raw).all() and expected.abs().max() > 0
    torch.testing.assert_close(raw, expected, rtol=1e-4, atol=1e-5 * float(expected.abs().max()))
