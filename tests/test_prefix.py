"""Occlusion's shared prefix: copies that differ from their image inside one window, their local prefix run on a
crop around the window alone, give the whole copies' outputs; a prefix read again later, or one that reads its
input's size, is never cut; a cut that gives other scores is dropped."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import hook_count, seeded
from torch import nn

import explain
from explain.core.speedups.folding import ScoringForwards
from explain.core.speedups.prefix import SharedPrefix

captum = pytest.importorskip("captum.attr", reason="captum: a test dependency (pip install -e '.[test]')")


@pytest.fixture(scope="module")
def model() -> nn.Module:
    return seeded("resnet18", num_classes=10)


def occluded(x: torch.Tensor, images: torch.Tensor, starts: torch.Tensor, window: int) -> torch.Tensor:
    """The copies by hand: image ``images[r]`` with the window at ``starts[r]`` set to 0."""
    copies = x[images].clone()
    for r, start in enumerate(starts.tolist()):
        copies[(r, slice(None), *(slice(s, s + window) for s in start))] = 0.0
    return copies


def crops_of(copies: torch.Tensor):
    return lambda regions: torch.stack([copies[(r, slice(None), *region)] for r, region in enumerate(regions)])


def test_copies_through_the_shared_prefix_are_the_whole_copies(model) -> None:
    """resnet18 at 160x160, two images, windows at the corners, the edges and inside (one cut at the edge)."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 160, 160)
    forwards = ScoringForwards(model, x.device)
    with torch.no_grad():
        prefix = SharedPrefix(forwards, x, (32, 32), {})
        assert prefix.cut is not None and prefix.cut.crop[0] < 160  # a cut, with crops smaller than the image
        starts = torch.tensor([[0, 0], [128, 128], [0, 128], [64, 0], [37, 91], [150, 20]])
        images = torch.tensor([0, 1, 1, 0, 1, 0])
        copies = occluded(x, images, starts, 32)
        torch.testing.assert_close(prefix(crops_of(copies), images, starts), forwards(copies), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["shufflenet_v2_x0_5", "regnet_x_400mf"])
def test_a_cut_at_a_concatenation_of_channels_or_after_grouped_convolutions(name) -> None:
    """ShuffleNet's prefix ends in a concatenation of its branches' channels; RegNet's holds grouped convolutions
    and is cut at stride 8."""
    net = seeded(name, num_classes=10)
    torch.manual_seed(0)
    x = torch.randn(1, 3, 160, 160)
    forwards = ScoringForwards(net, x.device)
    with torch.no_grad():
        prefix = SharedPrefix(forwards, x, (24, 24), {})
        assert prefix.cut is not None and prefix.cut.crop[0] < 160
        starts = torch.tensor([[0, 0], [136, 136], [70, 13]])
        images = torch.zeros(3, dtype=torch.long)
        copies = occluded(x, images, starts, 24)
        torch.testing.assert_close(prefix(crops_of(copies), images, starts), forwards(copies), rtol=1e-4, atol=1e-5)


def test_a_signal_s_prefix_is_cut_too() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv1d(2, 8, 7, stride=2, padding=3), nn.ReLU(), nn.MaxPool1d(3, 2, 1),
        nn.Conv1d(8, 8, 3, padding=1), nn.ReLU(), nn.Conv1d(8, 8, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(8, 3),
    ).eval()  # fmt: skip
    x = torch.randn(1, 2, 400)
    forwards = ScoringForwards(net, x.device)
    with torch.no_grad():
        prefix = SharedPrefix(forwards, x, (20,), {})
        assert prefix.cut is not None and prefix.cut.fields[0].stride == 4
        starts = torch.tensor([[0], [190], [380]])
        images = torch.zeros(3, dtype=torch.long)
        copies = occluded(x, images, starts, 20)
        torch.testing.assert_close(prefix(crops_of(copies), images, starts), forwards(copies), rtol=1e-4, atol=1e-5)


class StemReadAgain(nn.Module):
    """A stem whose output the head reads again, after the global pooling; its local body of 1x1 convolutions,
    lighter than the stem, would be worth cutting too."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.body = nn.Sequential(*(nn.Conv2d(8, 8, 1) for _ in range(3)))
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stem = self.stem(x).relu()
        return self.fc(self.body(stem).mean(dim=(2, 3))) + stem.amax(dim=(1, 2, 3))[:, None]


class SizeRead(nn.Module):
    """A segmenter that brings its logits back to its input's size."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(*(nn.Conv2d(3 if i == 0 else 8, 8, 3, padding=1) for i in range(4)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size = x.shape[-2:]
        return F.interpolate(self.body(x)[:, :, ::2, ::2], size=size).mean(dim=(2, 3))


def test_a_prefix_read_again_is_cut_only_before_that_read_and_one_that_reads_its_size_never() -> None:
    torch.manual_seed(0)
    x = torch.randn(1, 3, 96, 96)
    with torch.no_grad():
        again = StemReadAgain().eval()
        forwards = ScoringForwards(again, x.device)
        prefix = SharedPrefix(forwards, x, (8, 8), {})
        # the stem (a convolution and its ReLU) is all a cut may hold: the head reads the stem's output again
        assert prefix.cut is not None and prefix.cut.name == "relu"
        starts = torch.tensor([[0, 0], [44, 60]])
        images = torch.zeros(2, dtype=torch.long)
        copies = occluded(x, images, starts, 8)
        torch.testing.assert_close(prefix(crops_of(copies), images, starts), forwards(copies), rtol=1e-4, atol=1e-5)
        assert SharedPrefix(ScoringForwards(SizeRead().eval(), x.device), x, (8, 8), {}).cut is None


def test_occlusion_through_the_shared_prefix_is_captum_s(model, monkeypatch) -> None:
    """The prefix serves every batch of the call; a prefix whose first scores differ from the whole copies' is
    dropped, and the call's map is still Captum's."""
    torch.manual_seed(1)
    x = torch.randn(1, 3, 160, 160)
    theirs = captum.Occlusion(model).attribute(x, sliding_window_shapes=(3, 32, 32), strides=(3, 32, 32), target=3)
    calls = []
    real = SharedPrefix.__call__

    def counted(self, *args, **kwargs):
        calls.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(SharedPrefix, "__call__", counted)
    result = explain.methods.Occlusion(model, window=32, stride=32, batch_size=16)(x, 3)
    assert len(calls) == 2  # 25 placements, 16 per forward
    torch.testing.assert_close(result.raw, theirs[:, 0], rtol=1e-4, atol=1e-5)
    assert hook_count(model) == 0

    calls.clear()
    monkeypatch.setattr(SharedPrefix, "__call__", lambda self, *a, **k: counted(self, *a, **k) + 1.0)  # wrong scores
    result = explain.methods.Occlusion(model, window=32, stride=32, batch_size=16)(x, 3)
    assert len(calls) == 1
    torch.testing.assert_close(result.raw, theirs[:, 0], rtol=1e-4, atol=1e-5)


def squares(side: int, per_axis: int) -> torch.Tensor:
    """A label map of per_axis x per_axis square segments."""
    cell = torch.arange(side) * per_axis // side
    return cell[:, None] * per_axis + cell[None, :]


def test_superpixel_copies_share_the_prefix_of_their_image_or_of_the_baseline(model, monkeypatch) -> None:
    """Feature Ablation's copies each differ from their image in one segment: every one goes through the prefix,
    and the map is Captum's. Kernel SHAP's copies with one segment left out share their image's prefix, those with
    one segment kept the all-baseline input's; the values are those of the whole copies."""
    torch.manual_seed(2)
    x, segments = torch.randn(1, 3, 192, 192), squares(192, 6)  # 36 squares of 32x32
    bases: list[torch.Tensor] = []
    real = SharedPrefix.__call__

    def spied(self, crops, images, starts):
        bases.append(images)
        return real(self, crops, images, starts)

    monkeypatch.setattr(SharedPrefix, "__call__", spied)
    ablation = explain.methods.FeatureAblation(model, segments=segments, batch_size=8)(x, 3, normalize=False)
    theirs = captum.FeatureAblation(model).attribute(x, target=3, feature_mask=segments[None, None])
    assert sum(len(b) for b in bases) == 36  # every segment's copy
    torch.testing.assert_close(ablation.raw, theirs[:, 0], rtol=1e-4, atol=1e-5)

    bases.clear()
    shap = explain.methods.KernelSHAP(model, segments=segments, samples=200, seed=0, batch_size=16)
    shared = shap(x, 3, normalize=False)
    served = torch.cat(bases)
    assert (served == 0).any() and (served == 1).any()  # the image's prefix, and the all-baseline input's
    monkeypatch.setattr(explain.methods.masking, "shared_prefix_plan", lambda *args: None)
    whole = shap(x, 3, normalize=False)
    torch.testing.assert_close(shared.raw, whole.raw, rtol=1e-3, atol=1e-4)
    assert hook_count(model) == 0
