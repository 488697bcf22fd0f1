"""Layer-wise relevance propagation (explain.relevance) against zennit, the peer that has it: its three standard
composites with batch norms merged (zennit's SequentialMergeBatchNorm), a rule given for the first layer; and the
guarantees: relevance conserved where the rules conserve it, the model untouched after success and failure."""

from __future__ import annotations

import pytest
import torch
from conftest import hook_count, vgg_with_norms
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
    result = explain.LRP(vgg, composite=name, **box)(x, TARGETS, normalize=False)
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
    got = explain.LRP(vgg, composite="epsilon_gamma_box", rules=rules, low=-3.0, high=3.0)(x, TARGETS, normalize=False)
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
    result = explain.LRP(net, composite="epsilon")(x, [0, 3], normalize=False)
    assert not torch.allclose(net(x)[[0, 1], [0, 3]], torch.ones(2))
    torch.testing.assert_close(result.raw.sum(dim=(1, 2, 3)), torch.ones(2), rtol=1e-4, atol=1e-5)


def test_lrp_leaves_the_model_as_it_was_when_a_rule_raises_or_a_norm_trains(vgg, x) -> None:
    def broken(layer, inputs, relevance):
        raise RuntimeError("a rule that fails")

    before = {k: v.clone() for k, v in vgg.state_dict().items()}
    with pytest.raises(RuntimeError, match="a rule that fails"):
        explain.LRP(vgg, rules={nn.Linear: broken})(x, TARGETS)
    assert hook_count(vgg) == 0 and all(m.inplace for m in vgg.modules() if isinstance(m, nn.ReLU))
    vgg.features[1].train()
    try:
        with pytest.raises(explain.LayerError, match=r"call model\.eval"):
            explain.LRP(vgg)(x, TARGETS)
    finally:
        vgg.features[1].eval()
    assert all(torch.equal(v, vgg.state_dict()[k]) for k, v in before.items()) and hook_count(vgg) == 0
    with pytest.raises(explain.ExplainError, match="unknown LRP composite"):
        explain.LRP(vgg, composite="epsilon_minus")


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
    result = explain.LRP(vgg, "features.10")(x, TARGETS, normalize=False)
    assert result.layer == "features.10" and result.raw.shape == expected.shape
    torch.testing.assert_close(result.raw, expected, rtol=1e-4, atol=1e-5 * float(expected.abs().max()))
    summed = expected.sum(dim=1, keepdim=True).clamp(min=0)
    upsampled = torch.nn.functional.interpolate(summed, size=x.shape[2:], mode="bilinear", align_corners=False)
    torch.testing.assert_close(result.cams, upsampled[:, 0], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(result.completeness, expected.flatten(1).sum(1) - 1, rtol=1e-4, atol=1e-5)
    assert hook_count(vgg) == 0


def test_relevance_is_read_at_one_layer() -> None:
    with pytest.raises(explain.LayerError, match="one layer; 2 were given"):
        explain.LRP(nn.Sequential(nn.Conv2d(3, 4, 3)), ["0", "0"])
