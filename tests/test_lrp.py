"""Layer-wise relevance propagation (explain.relevance) against zennit, the peer that has it: its three standard
composites with batch norms merged (zennit's SequentialMergeBatchNorm), a rule given for the first layer; and the
guarantees: relevance conserved where the rules conserve it, the model untouched after success and failure."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import ASSETS, hook_count, vgg_with_norms
from torch import nn

import explain
from explain.relevance.rules import Flat, Gamma

zennit = pytest.importorskip("zennit", reason="zennit: a test dependency (pip install -e '.[test]')")

TARGETS = [1, 7]


@pytest.fixture(scope="module")
def vgg() -> nn.Module:
    """VGG-11 with batch norms, random weights and batch-norm statistics, in eval mode."""
    return vgg_with_norms()


@pytest.fixture(scope="module")
def x() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(2, 3, 32, 32)


def zennit_relevance(model: nn.Module, x: torch.Tensor, composite) -> torch.Tensor:
    from zennit.attribution import Gradient

    with Gradient(model=model, composite=composite) as attributor:
        _, relevance = attributor(x, torch.eye(10)[TARGETS])
    return relevance


@pytest.mark.parametrize("name", ["epsilon_plus", "epsilon_alpha2_beta1", "epsilon_gamma_box"])
def test_composites_are_zennit_s_with_batch_norms_merged(vgg, x, name) -> None:
    from zennit.canonizers import SequentialMergeBatchNorm
    from zennit.composites import EpsilonAlpha2Beta1, EpsilonGammaBox, EpsilonPlus

    box = {"low": -3.0, "high": 3.0} if name == "epsilon_gamma_box" else {}
    peer = {
        "epsilon_plus": EpsilonPlus,
        "epsilon_alpha2_beta1": EpsilonAlpha2Beta1,
        "epsilon_gamma_box": EpsilonGammaBox,
    }
    expected = zennit_relevance(vgg, x, peer[name](canonizers=[SequentialMergeBatchNorm()], **box))
    before = {k: v.clone() for k, v in vgg.state_dict().items()}
    result = explain.methods.LRP(vgg, composite=name, **box)(x, TARGETS, normalize=False)
    assert expected.abs().max() > 0
    torch.testing.assert_close(result.raw, expected, rtol=1e-4, atol=1e-5 * float(expected.abs().max()))
    torch.testing.assert_close(result.cams, expected.sum(dim=1).clamp(min=0), rtol=1e-4, atol=1e-6)
    assert all(torch.equal(v, vgg.state_dict()[k]) for k, v in before.items()) and hook_count(vgg) == 0
    assert all(m.inplace for m in vgg.modules() if isinstance(m, nn.ReLU))


def test_a_rule_for_the_first_layer_and_a_type_are_zennit_s(vgg, x) -> None:
    from zennit.canonizers import SequentialMergeBatchNorm
    from zennit.composites import EpsilonGammaBox
    from zennit.rules import Flat as ZennitFlat
    from zennit.rules import Gamma as ZennitGamma
    from zennit.types import Convolution

    peer = EpsilonGammaBox(
        low=-3.0, high=3.0, canonizers=[SequentialMergeBatchNorm()], first_map=[(Convolution, ZennitFlat())],
        layer_map=[(Convolution, ZennitGamma(gamma=0.5))],
    )  # fmt: skip
    expected = zennit_relevance(vgg, x, peer)
    rules = {"first": Flat(), nn.Conv2d: Gamma(0.5)}
    got = explain.methods.LRP(vgg, composite="epsilon_gamma_box", rules=rules, low=-3.0, high=3.0)(
        x, TARGETS, normalize=False
    )
    torch.testing.assert_close(got.raw, expected, rtol=1e-4, atol=1e-5 * float(expected.abs().max()))


def test_lrp_zero_conserves_the_score_through_a_bias_free_relu_network() -> None:
    """LRP-ε with ε -> 0 (LRP-0) on a network of bias-free linear layers and ReLUs: the input's relevance sums to
    the explained output's, 1 (relevance is conserved layer by layer), whatever the logit."""
    torch.manual_seed(4)
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.ReLU(), nn.AvgPool2d(2), nn.Conv2d(8, 8, 3, bias=False),
        nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 5, bias=False),
    ).eval()  # fmt: skip
    x = torch.randn(2, 3, 16, 16)
    result = explain.methods.LRP(net, composite="epsilon")(x, [0, 3], normalize=False)
    assert not torch.allclose(net(x)[[0, 1], [0, 3]], torch.ones(2))
    torch.testing.assert_close(result.raw.sum(dim=(1, 2, 3)), torch.ones(2), rtol=1e-4, atol=1e-5)


def test_lrp_leaves_the_model_as_it_was_when_a_rule_raises_or_a_norm_trains(vgg, x) -> None:
    def broken(layer, inputs, relevance):
        raise RuntimeError("a rule that fails")

    before = {k: v.clone() for k, v in vgg.state_dict().items()}
    with pytest.raises(RuntimeError, match="a rule that fails"):
        explain.methods.LRP(vgg, rules={nn.Linear: broken})(x, TARGETS)
    assert hook_count(vgg) == 0 and all(m.inplace for m in vgg.modules() if isinstance(m, nn.ReLU))
    vgg.features[1].train()
    try:
        with pytest.raises(explain.LayerError, match=r"call model\.eval"):
            explain.methods.LRP(vgg)(x, TARGETS)
    finally:
        vgg.features[1].eval()
    assert all(torch.equal(v, vgg.state_dict()[k]) for k, v in before.items()) and hook_count(vgg) == 0
    with pytest.raises(explain.ExplainError, match="unknown LRP composite"):
        explain.methods.LRP(vgg, composite="epsilon_minus")


def test_relevance_at_a_named_layer_is_zennit_s_arriving_there(vgg, x) -> None:
    """``layer=``: the relevance arriving at the layer's output, zennit's gradient there under its EpsilonPlus with
    batch norms merged; the map its positive part summed over channels, upsampled; completeness its sum minus 1."""
    from zennit.attribution import Gradient
    from zennit.canonizers import SequentialMergeBatchNorm
    from zennit.composites import EpsilonPlus

    kept: list[torch.Tensor] = []
    hooked = vgg.get_submodule("features.10").register_forward_hook(
        lambda m, i, o: o.register_hook(lambda g: kept.append(g)) and None
    )
    try:
        with Gradient(model=vgg, composite=EpsilonPlus(canonizers=[SequentialMergeBatchNorm()])) as attributor:
            attributor(x, torch.eye(10)[TARGETS])
    finally:
        hooked.remove()
    expected = kept[0]
    result = explain.methods.LRP(vgg, "features.10")(x, TARGETS, normalize=False)
    assert result.layer == "features.10" and result.raw.shape == expected.shape
    torch.testing.assert_close(result.raw, expected, rtol=1e-4, atol=1e-5 * float(expected.abs().max()))
    summed = expected.sum(dim=1, keepdim=True).clamp(min=0)
    upsampled = torch.nn.functional.interpolate(summed, size=x.shape[2:], mode="bilinear", align_corners=False)
    torch.testing.assert_close(result.cams, upsampled[:, 0], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(result.completeness, expected.flatten(1).sum(1) - 1, rtol=1e-4, atol=1e-5)
    assert hook_count(vgg) == 0


def test_relevance_is_read_at_one_layer() -> None:
    with pytest.raises(explain.LayerError, match="one layer; 2 were given"):
        explain.methods.LRP(nn.Sequential(nn.Conv2d(3, 4, 3)), ["0", "0"])


def calibrated(model: nn.Module, size: int, zero_biases: bool = False) -> nn.Module:
    """The model in float64 and eval mode, its batch norms' statistics those of random images of ``size``; with
    ``zero_biases``, every bias, batch-norm mean, position embedding and class token zero (each rule then
    conserves)."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    model = model.double()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            leaf = name.rpartition(".")[2]
            if zero_biases and ("bias" in leaf or leaf in ("pos_embed", "cls_token", "absolute_pos_embed")):
                parameter.zero_()
        for norm in norms:
            norm.reset_running_stats()
            norm.momentum = None  # the mean over the calibration batch
        model.train()
        model(torch.randn(8, 3, size, size, dtype=torch.float64, generator=torch.Generator().manual_seed(9)))
        for norm in norms:
            if zero_biases:
                norm.running_mean.zero_()
            elif norm.bias is not None:
                nn.init.normal_(norm.bias, std=0.1)
    return model.eval()


@pytest.mark.parametrize(
    ("name", "composite"),
    [("resnet18", "epsilon_plus"), ("resnet18", "epsilon_alpha2_beta1"), ("resnet50", "epsilon_plus")],
)
def test_resnets_are_zennit_s_with_its_resnet_canonizer(name: str, composite: str) -> None:
    """A torchvision ResNet with its biases: LRP against zennit's composite with its ``ResNetCanonizer`` (batch
    norms merged, the residual sum ruled as a sum): the maps correlate above 0.999, the sums within 1%."""
    import torchvision
    from zennit.composites import EpsilonAlpha2Beta1, EpsilonPlus
    from zennit.torchvision import ResNetCanonizer

    torch.manual_seed(0)
    model = calibrated(torchvision.models.get_model(name, num_classes=10), 64).float()
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(2))
    peer = {"epsilon_plus": EpsilonPlus, "epsilon_alpha2_beta1": EpsilonAlpha2Beta1}[composite]
    expected = zennit_relevance(model, x, peer(canonizers=[ResNetCanonizer()]))
    found = explain.methods.LRP(model, composite=composite)(x, TARGETS, normalize=False).raw
    assert torch.corrcoef(torch.stack([found.flatten(), expected.flatten()]))[0, 1] >= 0.999
    torch.testing.assert_close(found.flatten(1).sum(1), expected.flatten(1).sum(1), rtol=0.01, atol=1e-3)
    assert hook_count(model) == 0


def _vgg() -> nn.Module:
    import torchvision

    model = torchvision.models.vgg11_bn(num_classes=10)
    model.avgpool = nn.AdaptiveAvgPool2d(1)  # a small head: the 4096-wide one is 100M weights
    model.classifier = nn.Sequential(nn.Linear(512, 64), nn.ReLU(), nn.Dropout(), nn.Linear(64, 10))
    return model


def _family(name: str) -> nn.Module:
    """A network of a family users bring, small where the family allows, with random weights."""
    import timm
    import torchvision
    from torchvision.models.convnext import CNBlockConfig

    tv = torchvision.models
    built = {
        "resnet": lambda: tv.resnet18(num_classes=10),
        "vgg": _vgg,
        "efficientnet": lambda: tv.efficientnet_b0(num_classes=10),
        "mobilenet_v3": lambda: tv.mobilenet_v3_small(num_classes=10),
        "regnet_y": lambda: tv.regnet_y_400mf(num_classes=10),
        "convnext": lambda: tv.convnext.ConvNeXt([CNBlockConfig(32, 64, 1), CNBlockConfig(64, None, 1)], 0.0, 1e-6, 10),
        "densenet": lambda: tv.DenseNet(8, (2, 2), 16, num_classes=10),
        "timm_seresnet": lambda: timm.create_model("seresnet18", num_classes=10),
        "timm_efficientnet": lambda: timm.create_model("efficientnet_b0", num_classes=10),
        "timm_regnet": lambda: timm.create_model("regnety_002", num_classes=10),
        "timm_vit": lambda: timm.models.VisionTransformer(
            img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=10
        ),
        "timm_swin": lambda: timm.models.SwinTransformer(
            img_size=32, patch_size=4, window_size=4, embed_dim=16, depths=(1, 1), num_heads=(1, 2), num_classes=10
        ),
    }
    torch.manual_seed(0)
    return built[name]()


FAMILIES = ["resnet", "vgg", "efficientnet", "mobilenet_v3", "regnet_y", "convnext", "densenet", "timm_seresnet",
            "timm_efficientnet", "timm_regnet", "timm_vit", "timm_swin"]  # fmt: skip
TRANSFORMERS = {"timm_vit", "timm_swin"}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_conserves_the_score_without_biases(family: str) -> None:
    """Every bias and batch-norm mean zero, the variances those of random images, float64: lrp, attnlrp and cplrp
    hand the input the score's relevance, 1, within 0.05, and none of it grows far past the score on the way (a
    squeeze-excitation's gate is held constant); the result reports the sum's gap. AttnLRP's softmax rule (Deep
    Taylor at the softmax's input) does not conserve by its definition: on a transformer it reports its gap."""
    pytest.importorskip("timm")
    size = 32 if family in TRANSFORMERS else 64
    model = calibrated(_family(family), size, zero_biases=True)
    x = torch.randn(1, 3, size, size, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    for method in ("lrp", "attnlrp", "cplrp"):
        result = explain.create_method(method, model)(x, 3, normalize=False)
        total = float(result.raw.double().sum())
        assert float(result.completeness[0]) == pytest.approx(total - 1, abs=1e-5)
        if method == "attnlrp" and family in TRANSFORMERS:
            assert abs(total - 1) > 1e-3  # the softmax rule's gap, reported
            continue
        assert abs(total - 1) <= 0.05, (method, total)
        assert float(result.raw.double().abs().sum()) < 1e3, method


class Gated(nn.Module):
    """y = w · (x ⊙ σ(v · mean(x))): a signal of 6 samples scaled by one gate computed from its own mean."""

    def __init__(self) -> None:
        super().__init__()
        self.w, self.v = nn.Linear(6, 1, bias=False), nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            self.w.weight.copy_(torch.tensor([[0.5, -1.0, 2.0, 1.5, 0.25, 1.0]]))
            self.v.weight.fill_(0.8)

    def gate(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.v(x.mean(dim=2)))[:, :, None]  # (N, 1, 1): spread over the 6 samples

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w(x * self.gate(x)).flatten(1)


def test_a_gate_is_held_constant_or_shares_uniformly_as_asked() -> None:
    """The gate rule against its closed forms on :class:`Gated` (ε-LRP of y = Σ w_i g x_i): the signal-only gate
    (Pahde et al. 2023) gives :math:`R_i = w_i g x_i / y`; the uniform rule half of that, and the gate's half
    through its mean, :math:`x_i / (2 \\sum_j x_j)`."""
    model = Gated().double().eval()
    x = torch.tensor([[[1.0, 0.5, 2.0, 1.0, 3.0, 0.5]]], dtype=torch.float64)
    g = model.gate(x).detach()
    direct = model.w.weight.detach()[0] * g[0, 0] * x[0, 0] / model(x).detach()[0, 0]
    signal = explain.methods.AttnLRP(model)(x, 0, normalize=False).raw.double()[0, 0]
    torch.testing.assert_close(signal, direct, rtol=1e-4, atol=1e-6)
    uniform = explain.methods.AttnLRP(model, gate="uniform")(x, 0, normalize=False).raw.double()[0, 0]
    torch.testing.assert_close(uniform, direct / 2 + x[0, 0] / (2 * x.sum()), rtol=1e-4, atol=1e-6)
    with pytest.raises(explain.LayerError, match="gate must be one of signal, uniform"):
        explain.methods.LRP(model, gate="half")


def test_epsilon_is_the_epsilon_rule_s_and_every_front_end_honours_it(tmp_path) -> None:
    """``epsilon=`` is the ε of the ε rule: on a bias-free linear layer, :math:`R_x = x \\odot w \\, / (z + ε)`; the
    command line's ``--epsilon`` gives the API's map; a method without the rule refuses it."""
    from explain.cli import main

    layer = nn.Sequential(nn.Flatten(), nn.Linear(6, 2, bias=False)).double().eval()
    x = torch.rand(1, 1, 6, dtype=torch.float64) + 0.1
    z = layer(x).detach()[0, 1]
    for epsilon in (1e-9, 0.5):
        found = explain.methods.LRP(layer, composite="epsilon", epsilon=epsilon)(x, 1, normalize=False).raw.double()
        torch.testing.assert_close(found[0, 0], x[0, 0] * layer[1].weight.detach()[1] / (z + epsilon))
    out = tmp_path / "out"
    photo = str(ASSETS / "chelsea.png")
    lite0 = ["--model", "efficientnet_lite0"]
    assert main([photo, *lite0, "--method", "lrp", "--epsilon", "0.5", "--save-raw", "--quiet", "-o", str(out)]) == 0
    spec = explain.load_model("efficientnet_lite0")
    x = spec.preprocess(explain.load_image(photo))
    wide = explain.methods.LRP(spec.model, epsilon=0.5)(x, 285, normalize=False).raw[0]
    plain = explain.methods.LRP(spec.model)(x, 285, normalize=False).raw[0]
    saved = torch.from_numpy(np.load(out / "chelsea.lrp.npy"))  # the photo's class: Egyptian cat, 285
    torch.testing.assert_close(saved, wide, rtol=1e-4, atol=1e-6 * float(wide.abs().max()))
    assert (plain - wide).abs().max() > 0.1 * wide.abs().max()
    assert main([photo, *lite0, "--method", "gradcam", "--epsilon", "0.5", "-o", str(tmp_path / "b")]) == 2
