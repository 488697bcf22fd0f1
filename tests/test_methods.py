"""Every method against an independent float64 reference written here from its formula.

The references capture activations and gradients with a plain hook and
``torch.autograd.grad`` (see conftest.capture) and compute the maps image by
image, without the library; the library's raw maps must agree within 1e-5.
"""

from __future__ import annotations

import copy
from functools import partial

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import capture, seeded
from torch import nn

import explain
from explain.core.layers import traced_layers
from explain.targets import RegressionTarget

# model, layer, input side: a plain last stage, a conv whose output an in-place ReLU overwrites, a Hardswish stage.
GRADIENT_CASES = [("resnet18", "layer4", 96), ("vgg11", "features.18", 64), ("mobilenet_v3_small", "features", 96)]
# Score-CAM and Ablation-CAM cost a forward per channel: smaller layers and inputs.
PERTURBATION_CASES = [("resnet18", "layer2", 32), ("vgg11", "features.8", 32), ("mobilenet_v3_small", "features.6", 64)]
TARGETS = [7, 2]
PERTURBATION_TARGETS = [9, 8]


def inputs(side: int) -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(2, 3, side, side)


def spatial_sum(t: torch.Tensor) -> torch.Tensor:
    return t.sum(dim=(-2, -1), keepdim=True)


def first_component(weighted: torch.Tensor) -> torch.Tensor:
    """Projection on the first principal component (numpy SVD), sign agreeing with the channel sum."""
    maps = []
    for w in weighted.numpy():
        rows = w.reshape(w.shape[0], -1).T
        centred = rows - rows.mean(axis=0)
        _, _, vt = np.linalg.svd(centred, full_matrices=False)
        projection = centred @ vt[0]
        total = rows.sum(axis=1)
        if np.dot(projection, total - total.mean()) < 0:
            projection = -projection
        maps.append(projection.reshape(w.shape[1:]))
    return torch.from_numpy(np.stack(maps))


def reference_gradient_method(method: str, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The map of each gradient method from its paper's formula (A, g: (N, C, h, w) float64)."""
    if method == "gradcampp":
        denominator = 2 * g**2 + spatial_sum(a) * g**3
        alpha = torch.zeros_like(g)
        nonzero = denominator != 0
        alpha[nonzero] = g[nonzero] ** 2 / denominator[nonzero]
        weights = (alpha * g.clamp(min=0)).sum(dim=(-2, -1))
        return (weights[..., None, None] * a).sum(1).clamp(min=0)
    if method == "xgradcam":
        weights = (a / (spatial_sum(a) + 1e-7) * g).sum(dim=(-2, -1))
        return (weights[..., None, None] * a).sum(1).clamp(min=0)
    if method == "hirescam":
        return (g * a).sum(1).clamp(min=0)
    if method == "gradcam_elementwise":
        return (g * a).clamp(min=0).sum(1)
    if method == "layercam":
        return (g.clamp(min=0) * a).sum(1).clamp(min=0)
    if method == "eigengradcam":
        return first_component(g * a).clamp(min=0)
    raise AssertionError(method)


def assert_close_maps(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.dtype == torch.float32 and got.shape == expected.shape
    assert expected.abs().amax() > 0, "reference maps must not be trivially zero"
    assert (got.double() - expected).abs().max().item() <= 1e-5


GRADIENT_METHODS = ["gradcampp", "xgradcam", "hirescam", "gradcam_elementwise", "layercam", "eigengradcam"]


@pytest.mark.parametrize("method", GRADIENT_METHODS)
@pytest.mark.parametrize(("name", "layer", "side"), GRADIENT_CASES)
def test_gradient_methods_match_reference(method: str, name: str, layer: str, side: int) -> None:
    model = seeded(name, num_classes=10)
    x = inputs(side)
    a, g = capture(model, x, layer, TARGETS)
    got = explain.cam(model, x, method, layer, TARGETS, resize=False, normalize=False)
    assert_close_maps(got, reference_gradient_method(method, a, g))


@pytest.mark.parametrize(("name", "layer", "side"), GRADIENT_CASES)
def test_activation_methods_match_reference(name: str, layer: str, side: int) -> None:
    model = seeded(name, num_classes=10)
    x = inputs(side)
    a, _ = capture(model, x, layer, TARGETS)
    got = explain.cam(model, x, "eigencam", layer, TARGETS, resize=False, normalize=False)
    assert_close_maps(got, first_component(a).clamp(min=0))

    torch.manual_seed(5)
    expected = (2 * torch.rand(a.shape[:2], dtype=torch.float32).double() - 1)[..., None, None]
    got = explain.cam(model, x, "random", layer, TARGETS, resize=False, normalize=False, seed=5)
    assert_close_maps(got, (expected * a).sum(1).clamp(min=0))


@pytest.mark.parametrize("method", ["eigencam", "kpcacam"])
def test_a_class_agnostic_map_is_computed_once_for_every_target(method: str, monkeypatch) -> None:
    """Eigen-CAM and KPCA-CAM with three targets: one projection per pass, the same map for each target, the
    reference's."""
    from explain.core import maps
    from explain.methods import activation

    calls = []
    for name in ("principal_projection", "kernel_projection"):
        real = getattr(maps, name)
        monkeypatch.setattr(activation, name, lambda a, *args, real=real, **kw: calls.append(1) or real(a, *args, **kw))
    model = seeded("resnet18", num_classes=10)
    x = inputs(64)
    result = explain.METHODS[method](model, "layer3")(x, explain.targets.TopK(3), resize=False, normalize=False)
    assert len(calls) == 1 and result.cams.shape[:2] == (len(x), 3)
    assert torch.equal(result.cams[:, 0], result.cams[:, 2])
    a, _ = capture(model, x, "layer3", TARGETS)
    projection = first_component(a) if method == "eigencam" else maps.kernel_projection(a.double())
    assert_close_maps(result.cams[:, 1], projection.clamp(min=0))


@pytest.mark.parametrize(("kernel", "solver"), [("sigmoid", "full"), ("rbf", "full"), ("sigmoid", "top pair")])
def test_kpca_cam_is_pytorch_grad_cam_s_kernel_pca(kernel: str, solver: str, monkeypatch) -> None:
    """KPCA-CAM against pytorch-grad-cam's projection (scikit-learn's KernelPCA) of the same activations, each
    image's sign fixed by explain's rule (the principal component's sign is arbitrary), then the ReLU; by the
    whole eigendecomposition, and by the top pair alone (what maps of more than FULL_EIGH_LIMIT positions get)."""
    from pytorch_grad_cam.utils.svd_on_activations import get_2d_projection_kernel

    from explain.core import maps

    if solver == "top pair":
        monkeypatch.setattr(maps, "FULL_EIGH_LIMIT", 8)  # layer3's 6 x 6 = 36 positions

    model = seeded("resnet18", num_classes=10)
    x = inputs(96)
    a, _ = capture(model, x, "layer3", TARGETS)
    peer = torch.from_numpy(get_2d_projection_kernel(a.float().numpy(), kernel)).double()  # (N, h, w)
    total = a.sum(dim=1)
    agreement = (peer * (total - total.mean(dim=(1, 2), keepdim=True))).sum(dim=(1, 2))
    peer = torch.where(agreement[:, None, None] < 0, -peer, peer).clamp(min=0)
    got = explain.cam(model, x, "kpcacam", "layer3", TARGETS, resize=False, normalize=False, kernel=kernel)
    assert peer.abs().max() > 0
    assert (got.double() - peer).abs().max() <= 1e-4 * peer.abs().max()


def test_seg_eigen_cam_is_pytorch_grad_cam_s() -> None:
    """Seg-Eigen-CAM against pytorch-grad-cam's projection of |g| * A with the paper's sign correction, on the
    same activations and gradients, then the ReLU."""
    from pytorch_grad_cam import SegEigenCAM

    model = seeded("resnet18", num_classes=10)
    x = inputs(96)
    a, g = capture(model, x, "layer3", TARGETS)
    peer = SegEigenCAM(model=model, target_layers=[model.layer3])
    expected = peer.get_cam_image(x, None, None, a.float().numpy(), g.float().numpy(), False)
    expected = torch.from_numpy(expected).double().clamp(min=0)
    got = explain.cam(model, x, "segeigencam", "layer3", TARGETS, resize=False, normalize=False)
    assert expected.abs().max() > 0
    assert (got.double() - expected).abs().max() <= 1e-4 * expected.abs().max()


def test_fem_is_pytorch_grad_cam_s() -> None:
    """FEM against pytorch-grad-cam's formula on the same activations (its k = 2), then the ReLU."""
    from pytorch_grad_cam import FEM

    model = seeded("resnet18", num_classes=10)
    x = inputs(96)
    a, _ = capture(model, x, "layer3", TARGETS)
    peer = FEM(model=model, target_layers=[model.layer3]).get_cam_image(x, None, None, a.float().numpy(), None, False)
    expected = torch.from_numpy(peer).double().clamp(min=0)
    got = explain.cam(model, x, "fem", "layer3", TARGETS, resize=False, normalize=False)
    assert expected.abs().max() > 0
    assert_close_maps(got, expected)
    half = explain.cam(model, x, "fem", "layer3", TARGETS, resize=False, normalize=False, k=0.5)
    assert not torch.allclose(half, got)  # k moves the threshold


def test_original_cam_uses_the_classifier_row_without_relu() -> None:
    model = seeded("resnet18", num_classes=10)
    x = inputs(64)
    a, _ = capture(model, x, "layer4", TARGETS)
    rows = model.fc.weight.detach().double()[TARGETS]
    expected = (rows[..., None, None] * a).sum(1)
    assert (expected < 0).any(), "the map has negative parts, which CAM keeps"
    got = explain.cam(model, x, "cam", "layer4", TARGETS, resize=False, normalize=False)
    assert (got.double() - expected).abs().max().item() <= 1e-5
    with pytest.raises(explain.LayerError, match="the last linear layer 'fc' reads 512"):
        explain.cam(model, x, "cam", "layer3")
    with pytest.raises(explain.LayerError, match=r"'classifier\.3' reads 1024"):  # a hidden layer before the classifier
        explain.cam(seeded("mobilenet_v3_small", num_classes=10), x, "cam", "features")
    for target in (lambda logits: logits[:, 3], RegressionTarget(index=3)):  # no class row to weigh with
        with pytest.raises(explain.TargetError, match="this target is not a classifier's class"):
            explain.cam(model, x, "cam", "layer4", target)


def masked_scores(model: nn.Module, x: torch.Tensor, a: torch.Tensor, factors, targets: list[int]) -> torch.Tensor:
    """Score-CAM family reference: per image and channel, the mean target score over masks factor(mask)."""
    scores = torch.zeros(a.shape[:2], dtype=torch.float64)
    with torch.no_grad():
        for n in range(a.shape[0]):
            up = F.interpolate(a[n][:, None].float(), size=x.shape[-2:], mode="bilinear", align_corners=False)
            low, high = up.amin(dim=(1, 2, 3), keepdim=True), up.amax(dim=(1, 2, 3), keepdim=True)
            masks = torch.where(high > low, (up - low) / (high - low), 0.0)
            per_step = [model(x[n] * factor(n, masks))[:, targets[n]] for factor in factors]
            scores[n] = torch.stack(per_step).double().mean(0)
    return scores


def weighted_map(weights: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    return (weights[..., None, None] * a).sum(1).clamp(min=0)


def well_conditioned(model: nn.Module) -> nn.Module:
    """A random network made to behave like a trained one where Score-CAM and Ablation-CAM look.

    BatchNorm statistics are set from random images (else the signal of a random
    mobilenet_v3_small fades to ~1e-8 and every ablation changes nothing), and the
    classifier's scores are shifted by +3 (random networks score near 0, where
    Ablation-CAM's division by the score would magnify float32 rounding).
    """
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.momentum = None  # a plain average over the calibration batch
    torch.manual_seed(3)
    with torch.no_grad():
        model.train()(torch.randn(8, 3, 64, 64))
        [m for m in model.modules() if isinstance(m, nn.Linear)][-1].bias += 3.0
    return model.eval()


@pytest.mark.parametrize(("name", "layer", "side"), PERTURBATION_CASES)
def test_score_cam_and_ablation_cam_match_reference(name: str, layer: str, side: int) -> None:
    model = well_conditioned(seeded(name, num_classes=10))
    x = inputs(side)
    targets = PERTURBATION_TARGETS
    a, _ = capture(model, x, layer, targets)

    expected = weighted_map(masked_scores(model, x, a, [lambda n, m: m], targets).softmax(1), a)
    got = explain.cam(model, x, "scorecam", layer, targets, resize=False, normalize=False, batch_size=50)
    assert_close_maps(got, expected)

    with torch.no_grad():
        y = model(x)[range(2), targets].double()
        ablated = torch.zeros(a.shape[:2], dtype=torch.float64)
        for n in range(2):
            for c in range(a.shape[1]):
                values = a[n : n + 1].float().clone()
                values[0, c] = 0
                handle = model.get_submodule(layer).register_forward_hook(lambda m, i, o, v=values: v)
                ablated[n, c] = model(x[n : n + 1])[0, targets[n]].double()
                handle.remove()
    expected = weighted_map((y[:, None] - ablated) / y[:, None], a)
    got = explain.cam(model, x, "ablationcam", layer, targets, resize=False, normalize=False, batch_size=50)
    assert_close_maps(got, expected)


class TwoLevels(nn.Module):
    """A backbone returning a dict of two levels (as torchvision's feature pyramids do), read by a linear head."""

    class Backbone(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 3, 2, 1)

        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            fine = self.a(x)
            return {"0": fine, "1": self.b(fine)}

    def __init__(self) -> None:
        super().__init__()
        self.backbone, self.fc = self.Backbone(), nn.Linear(8, 5)

    def head(self, levels: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.fc(torch.cat([levels["0"].mean((2, 3)), levels["1"].mean((2, 3))], dim=1)) + 3.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


def test_ablation_cam_at_an_entry_of_a_dict_output_ablates_that_entry_alone() -> None:
    torch.manual_seed(0)
    model, x, targets = TwoLevels().eval(), torch.randn(2, 3, 12, 12), [1, 3]
    with torch.no_grad():
        levels = model.backbone(x)
        a = levels["0"]
        y = model.head(levels)[range(2), targets]
        ablated = torch.zeros(2, 4)
        for c in range(4):
            values = a.clone()
            values[:, c] = 0
            ablated[:, c] = model.head({"0": values, "1": levels["1"]})[range(2), targets]
    expected = weighted_map((y[:, None] - ablated) / y[:, None], a)
    got = explain.cam(model, x, "ablationcam", "backbone:0", targets, resize=False, normalize=False)
    assert_close_maps(got, expected)


def test_ss_cam_and_is_cam_match_reference() -> None:
    model = seeded("resnet18", num_classes=10)
    x = inputs(32)
    a, _ = capture(model, x, "layer2", TARGETS)
    rows, samples = a.shape[0] * a.shape[1], 3

    generator = torch.Generator().manual_seed(11)
    noise = [torch.randn((rows, 1, 32, 32), generator=generator).view(2, -1, 1, 32, 32) for _ in range(samples)]
    steps = [lambda n, m, e=e: m + 0.5 * e[n] for e in noise]
    expected = weighted_map(masked_scores(model, x, a, steps, TARGETS).softmax(1), a)
    options = {"samples": samples, "batch_size": rows, "seed": 11}
    got = explain.cam(model, x, "sscam", "layer2", TARGETS, resize=False, normalize=False, sigma=0.5, **options)
    assert_close_maps(got, expected)

    betas = [sum(j / samples for j in range(1, i + 1)) for i in range(1, samples + 1)]
    steps = [lambda n, m, b=b: b * m for b in betas]
    expected = weighted_map(masked_scores(model, x, a, steps, TARGETS).softmax(1), a)
    got = explain.cam(model, x, "iscam", "layer2", TARGETS, resize=False, normalize=False, samples=samples)
    assert_close_maps(got, expected)


class GuidedReLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.clamp(min=0)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad.clamp(min=0) * (x > 0)


class GuidedReLUModule(nn.Module):
    def forward(self, x):
        return GuidedReLU.apply(x)


def reference_guided(model: nn.Module, x: torch.Tensor, targets: list[int]) -> torch.Tensor:
    """Guided Backpropagation from its definition: a copy of the model whose ReLUs pass back positive gradients."""
    guided = copy.deepcopy(model)
    for parent in list(guided.modules()):
        for child_name, child in parent.named_children():
            if isinstance(child, nn.ReLU):
                setattr(parent, child_name, GuidedReLUModule())
    x = x.clone().requires_grad_(True)
    logits = guided(x)
    (grad,) = torch.autograd.grad(sum(logits[i, t] for i, t in enumerate(targets)), x)
    return grad.double()


@pytest.mark.parametrize(("name", "layer", "side"), GRADIENT_CASES)
def test_guided_backprop_and_guided_gradcam_match_reference(name: str, layer: str, side: int) -> None:
    model = seeded(name, num_classes=10)
    x = inputs(side)
    expected = reference_guided(model, x, TARGETS)
    scale = max(1.0, expected.abs().max().item())  # input gradients of random networks can be large
    got = explain.cam(model, x, "guided_backprop", target=TARGETS, normalize=False)
    assert got.shape == (2, 3, side, side)
    assert (got.double() - expected).abs().max().item() <= 1e-5 * scale

    cams = explain.gradcam(model, x, layer, TARGETS)
    got = explain.cam(model, x, "guided_gradcam", layer, TARGETS, normalize=False)
    assert (got.double() - expected * cams[:, None].double()).abs().max().item() <= 1e-5 * scale

    shown = explain.cam(model, x, "guided_backprop", target=TARGETS)
    assert shown.min() >= 0 and shown.max() <= 1
    for image, gradient in zip(shown.double(), expected):
        standardized = (gradient - gradient.mean()) / gradient.std()
        assert (image - (0.5 + 0.1 * standardized).clamp(0, 1)).abs().max().item() <= 1e-5


def test_guided_gradcam_topk_runs_grad_cam_once(name: str = "resnet18", layer: str = "layer3") -> None:
    """With topk, Grad-CAM runs once for all K classes (one guided pass plus one Grad-CAM pass), and each of
    the K maps is the guided gradient of its class times that class's Grad-CAM."""
    model = seeded(name, num_classes=10)
    x = inputs(64)
    traced_layers(model, x)  # the layouts' trace, once per model and input shape, is not the method's cost
    forwards = []
    handle = model.register_forward_hook(lambda *args: forwards.append(1))
    try:
        result = explain.methods.GuidedGradCAM(model, layer)(x, topk=3, normalize=False)
    finally:
        handle.remove()
    assert len(forwards) == 2 and result.cams.shape == (2, 3, 3, 64, 64)
    for k in range(3):
        classes = result.class_indices[:, k].tolist()
        cams = explain.gradcam(model, x, layer, classes)
        expected = reference_guided(model, x, classes) * cams[:, None].double()
        scale = max(1.0, expected.abs().max().item())
        assert (result.cams[:, k].double() - expected).abs().max().item() <= 1e-5 * scale


def test_method_names_and_options_are_checked() -> None:
    model = seeded("resnet18", num_classes=10)
    x = inputs(32)
    with pytest.raises(explain.ExplainError, match="unknown method 'gradcamm'; did you mean: gradcam"):
        explain.cam(model, x, "gradcamm")
    with pytest.raises(explain.ExplainError, match="aug_smooth do not apply to method 'guided_backprop'"):
        explain.cam(model, x, "guided_backprop", aug_smooth=True)
    with pytest.raises(explain.ExplainError, match="samples do not apply to method 'scorecam'"):
        explain.cam(model, x, "scorecam", samples=3)
    with pytest.raises(explain.ExplainError, match="fuse must be one of 'mean', 'max', 'product'"):
        explain.cam(model, x, "gradcam", ["layer3", "layer4"], fuse="median")
    slow = {name for name, cls in explain.METHODS.items() if not cls.fast}  # what the class says of itself
    assert set(explain.FAST_METHODS) == set(explain.METHODS) - slow and {"scorecam", "lime", "dff"} <= slow


def test_catalogue_names_every_method_class_once() -> None:
    """The torch-free catalogue (``--method list``), read from the classes' source, holds every method class of
    every module of ``explain.methods`` once, with what the imported class says: a method is its class alone."""
    import importlib
    import inspect
    import pkgutil

    import explain.methods
    from explain.catalog import METHOD_CATALOG

    files = [
        importlib.import_module(f"explain.methods.{info.name}")
        for info in pkgutil.iter_modules(explain.methods.__path__)
    ] + [importlib.import_module("explain.relevance.propagation")]
    classes = {
        cls
        for module in files
        for _, cls in inspect.getmembers(module, inspect.isclass)
        if cls.__module__ == module.__name__ and "name" in cls.__dict__
    }
    assert {explain.METHODS[entry.name] for entry in METHOD_CATALOG} == classes
    assert len(METHOD_CATALOG) == len(classes) == len(explain.METHODS)
    for entry in METHOD_CATALOG:
        cls = explain.METHODS[entry.name]
        assert (cls.name, cls.__name__, cls.title, cls.fast, cls.cost) == (
            entry.name, entry.cls, entry.title, entry.fast, entry.cost
        )  # fmt: skip
        assert cls.title and getattr(explain.methods, entry.cls) is cls and entry.cls in explain.methods.__all__
    from explain.catalog import METHOD_MODULES

    assert sorted(METHOD_MODULES) == sorted(module.__name__.removeprefix("explain.") for module in files)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("method", ["gradcampp", "eigengradcam", "scorecam", "ablationcam", "guided_backprop"])
def test_cuda_matches_cpu(method: str) -> None:
    model = well_conditioned(seeded("resnet18", num_classes=10))
    x = inputs(32)
    on_cpu = explain.cam(model, x, method, "layer2", PERTURBATION_TARGETS, normalize=False)
    on_gpu = explain.cam(model.cuda(), x.cuda(), method, "layer2", PERTURBATION_TARGETS, normalize=False)
    assert on_gpu.device.type == "cuda"
    torch.testing.assert_close(on_gpu.cpu(), on_cpu, atol=1e-4, rtol=1e-3)


def peer_maps(peer, x: torch.Tensor, targets: list[int] | None) -> torch.Tensor:
    """A pytorch-grad-cam method's normalized maps at the input's size, for one class per image (None: its own
    default targets)."""
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

    chosen = None if targets is None else [ClassifierOutputTarget(t) for t in targets]
    return torch.from_numpy(peer(input_tensor=x, targets=chosen)).float()


def assert_same_picture(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Normalized maps agree: correlation of at least 0.999 per image, and within 1e-3 everywhere (the peer's
    cv2 resizing and float32 numpy against explain's torch)."""
    assert got.shape == expected.shape and expected.amax() > 0
    for a, b in zip(got.flatten(1), expected.flatten(1)):
        assert torch.corrcoef(torch.stack([a, b]))[0, 1] >= 0.999
    assert (got - expected).abs().max() <= 1e-3


def smooth_net() -> nn.Module:
    """A small CNN of smooth activations (a Hessian through the head that is not zero), seeded, in eval mode."""
    torch.manual_seed(3)
    features = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.SiLU(),
        nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.SiLU(),
        nn.Conv2d(16, 16, 3, padding=1), nn.Tanh(), nn.Conv2d(16, 16, 1), nn.SiLU(),
    )  # fmt: skip
    return nn.Sequential(features, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10)).eval()


def test_shapley_cam_is_pytorch_grad_cam_s_and_its_hessian_term_counts() -> None:
    """ShapleyCAM against pytorch-grad-cam's on a SiLU network (a nonzero Hessian through the head): the same
    maps, and not Grad-CAM's (the -H·A/2 term moves the weights). The term itself against a double backward written
    here. A head without second derivatives in PyTorch (Hardsigmoid) is a clear error."""
    from pytorch_grad_cam import ShapleyCAM

    model = smooth_net()
    x = inputs(32)
    layer = "0.2"
    expected = peer_maps(ShapleyCAM(model=model, target_layers=[model.get_submodule(layer)]), x, TARGETS)
    got = explain.cam(model, x, "shapleycam", layer, TARGETS)
    assert_same_picture(got, expected)
    assert (got - explain.cam(model, x, "gradcam", layer, TARGETS)).abs().max() > 0.02

    kept = {}
    handle = model.get_submodule(layer).register_forward_hook(lambda m, i, o: kept.setdefault("a", o))
    try:
        logits = model(x)
    finally:
        handle.remove()
    a = kept["a"]
    (g,) = torch.autograd.grad(logits[range(2), TARGETS].sum(), a, create_graph=True)
    (hvp,) = torch.autograd.grad(g, a, grad_outputs=a.detach())
    weights = (g - 0.5 * hvp).mean(dim=(2, 3)).detach().double()
    reference = (weights[..., None, None] * a.detach().double()).sum(1).clamp(min=0)
    assert_close_maps(explain.cam(model, x, "shapleycam", layer, TARGETS, resize=False, normalize=False), reference)
    with pytest.raises(explain.LayerError, match="no second derivative"):
        explain.cam(seeded("mobilenet_v3_small", num_classes=10), x, "shapleycam", "features.9", TARGETS)


def test_shapley_cam_reaches_through_a_transformers_fused_attention() -> None:
    """A timm ViT (fused scaled dot-product attention, whose gradient PyTorch cannot differentiate again) at an
    early block: ShapleyCAM's Hessian term runs through the later blocks' attention by the math kernel, equal to a
    double backward written here over the patch tokens (the class token left out)."""
    import timm
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=10, img_size=64).eval()
    x, layer = inputs(64), "blocks.8"
    kept = {}
    handle = vit.get_submodule(layer).register_forward_hook(lambda m, i, o: kept.setdefault("a", o))
    try:
        with sdpa_kernel([SDPBackend.MATH]):
            logits = vit(x)
            a = kept["a"]
            (g,) = torch.autograd.grad(logits[range(2), TARGETS].sum(), a, create_graph=True)
            (hvp,) = torch.autograd.grad(g, a, grad_outputs=a.detach())
    finally:
        handle.remove()
    patches, g, hvp = a.detach()[:, 1:].double(), g.detach()[:, 1:].double(), hvp[:, 1:].double()  # (N, 16, C)
    weights = (g - 0.5 * hvp).mean(dim=1)
    reference = (patches * weights[:, None]).sum(dim=2).clamp(min=0).view(2, 4, 4)
    assert (hvp.abs().max() > 1e-3 * g.abs().max()) and reference.max() > 0
    assert_close_maps(explain.cam(vit, x, "shapleycam", layer, TARGETS, resize=False, normalize=False), reference)


def test_finer_cam_is_pytorch_grad_cam_s_with_the_look_alikes_or_given_classes() -> None:
    """Finer-CAM against pytorch-grad-cam's (the top class against its three nearest logits), and with the
    comparison classes given against Grad-CAM of the contrast written as a callable target."""
    from pytorch_grad_cam import FinerCAM

    model = seeded("resnet18", num_classes=10)
    x = inputs(64)
    peer = FinerCAM(model=model, target_layers=[model.layer3])
    expected = torch.from_numpy(peer(input_tensor=x, targets=None)).float()
    got = explain.METHODS["finercam"](model, "layer3")(x)
    assert_same_picture(got.cams, expected)
    assert torch.equal(got.class_indices, model(x).argmax(dim=1))

    def contrast(logits: torch.Tensor) -> torch.Tensor:
        p = logits.softmax(dim=1)[:, [4, 6]]
        return (p * (logits[:, [3]] - 0.5 * logits[:, [4, 6]])).sum(1) / (p.sum(1) + 1e-9)

    given = explain.cam(model, x, "finercam", "layer3", 3, against=[4, 6], alpha=0.5, normalize=False)
    torch.testing.assert_close(given, explain.gradcam(model, x, "layer3", contrast, normalize=False))
    with pytest.raises(explain.TargetError, match="the explained class itself"):
        explain.cam(model, x, "finercam", "layer3", 4, against=[4, 6])
    with pytest.raises(explain.TargetError, match="contrasts a classifier's classes"):
        explain.cam(model, x, "finercam", "layer3", explain.targets.RegressionTarget())


def test_finer_cam_of_the_top_k_classes_is_each_class_s_own_finer_cam() -> None:
    """With topk, each of the K explained classes is contrasted with its own look-alikes (nearest to its logit,
    never itself): map k is the Finer-CAM of image i's k-th class asked for alone, and so is ContrastTarget(TopK)."""
    model = seeded("resnet18", num_classes=10)
    x = inputs(64)
    finer = explain.METHODS["finercam"](model, "layer3", nearest=2)
    got = finer(x, topk=3, normalize=False)
    ranked = model(x).topk(3, dim=1).indices
    assert got.cams.shape == (len(x), 3, 64, 64) and torch.equal(got.class_indices, ranked)
    assert not torch.allclose(got.cams[:, 0], got.cams[:, 1])
    for k in range(3):
        alone = finer(x, ranked[:, k].tolist(), normalize=False)
        torch.testing.assert_close(got.cams[:, k], alone.cams)
    contrast = explain.targets.ContrastTarget(explain.targets.TopK(3), nearest=2)
    torch.testing.assert_close(explain.GradCAM(model, "layer3")(x, contrast, normalize=False).cams, got.cams)


def test_refine_cam_is_pytorch_grad_cam_s_product_of_layers() -> None:
    """RefineCAM against pytorch-grad-cam's: Grad-CAM++ of each layer, normalized at the input, multiplied. The
    logits are scaled up so that the peer's 1e-7 in Grad-CAM++'s denominator (explain has none) is negligible."""
    from pytorch_grad_cam import RefineCAM

    model = seeded("resnet18", num_classes=10)
    with torch.no_grad():
        model.fc.weight.mul_(1e3)
    x = inputs(64)
    peer = RefineCAM(model=model, target_layers=[model.layer2, model.layer3, model.layer4])
    expected = peer_maps(peer, x, TARGETS)
    got = explain.cam(model, x, "refinecam", ["layer2", "layer3", "layer4"], TARGETS)
    assert_same_picture(got, expected)


def full_gradient_terms(model: nn.Module, x: torch.Tensor, targets: list[int]) -> list[torch.Tensor]:
    """FullGrad's terms written from the paper: |x * dS/dx|, then |b * dS/dz| of every conv and batch norm with a
    bias (z its output; a batch norm's bias folded with its running statistics), float64."""
    outputs, handles = {}, []

    def keep(name: str, module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        outputs[name] = output
        return output.clone()  # the model's in-place ReLUs change the copy, not the output kept

    for name, module in model.named_modules():
        if isinstance(module, (nn.Conv2d, nn.BatchNorm2d)) and module.bias is not None:
            handles.append(module.register_forward_hook(partial(keep, name)))
    x = x.clone().requires_grad_(True)
    try:
        logits = model(x)
    finally:
        for handle in handles:
            handle.remove()
    names = list(outputs)
    grads = torch.autograd.grad(logits[range(len(targets)), targets].sum(), [x, *(outputs[n] for n in names)])
    terms = [(x.detach() * grads[0]).abs().double()]
    for name, g in zip(names, grads[1:]):
        m = model.get_submodule(name)
        bias = m.bias.detach().double()
        if isinstance(m, nn.BatchNorm2d):
            bias = bias - m.running_mean.double() * m.weight.detach().double() / (m.running_var.double() + m.eps).sqrt()
        terms.append((bias[None, :, None, None] * g.double()).abs())
    return terms


def test_fullgrad_is_the_paper_s_sum_and_pytorch_grad_cam_s_with_channel_scaling() -> None:
    """FullGrad with the paper's scaling (each term rescaled as a whole) against the terms computed here; with
    ``scaling="channel"`` against pytorch-grad-cam's. Its layers are its own; in training mode it is refused."""
    from pytorch_grad_cam import FullGrad

    model = seeded("resnet18", num_classes=10)
    torch.manual_seed(2)
    for m in model.modules():  # freshly built batch norms have zero biases: give them some, and statistics
        if isinstance(m, nn.BatchNorm2d):
            nn.init.normal_(m.bias, std=0.5)
            nn.init.normal_(m.running_mean, std=0.5)
            nn.init.uniform_(m.running_var, 0.5, 2.0)
    x = inputs(64)
    expected = 0
    for term in full_gradient_terms(model, x, TARGETS):
        flat = term.flatten(1)
        scaled = (flat - flat.amin(1, keepdim=True)) / (flat.amax(1, keepdim=True) - flat.amin(1, keepdim=True))
        expected = expected + F.interpolate(scaled.view_as(term).sum(1, keepdim=True), size=(64, 64), mode="bilinear")
    result = explain.METHODS["fullgrad"](model)(x, TARGETS, normalize=False)
    norms = sum(isinstance(m, nn.BatchNorm2d) for m in model.modules())  # its convolutions have no bias
    assert result.layer == f"input+{norms} bias layers"  # the linear head's bias is no map: left out
    torch.testing.assert_close(result.cams.double(), expected[:, 0], rtol=0, atol=1e-4)

    peer = peer_maps(FullGrad(model=model, target_layers=[]), x, TARGETS)
    assert_same_picture(explain.cam(model, x, "fullgrad", None, TARGETS, scaling="channel"), peer)
    with pytest.raises(explain.LayerError, match=r"call model\.eval"):
        explain.cam(model.train(), x, "fullgrad", None, TARGETS)


def test_deep_feature_factorization_factorizes_the_batch_like_pytorch_grad_cam() -> None:
    """DFF's concepts: their vectors and maps rebuild the shifted activations as well as pytorch-grad-cam's (its
    scikit-learn coordinate descent) do; the head scores the vectors; as a method, each image's map is the concept
    that ranks its class highest; the figure draws every concept."""
    from pytorch_grad_cam import DeepFeatureFactorization

    model = seeded("resnet18", num_classes=10)
    x = inputs(64)
    a, _ = capture(model, x, "layer4", TARGETS)
    shifted = a.transpose(0, 1).reshape(a.shape[1], -1)
    shifted = shifted - shifted.amin(dim=1, keepdim=True)

    method = explain.METHODS["dff"](model, "layer4", concepts=4, iterations=400, seed=0)
    found = method.concepts(x)
    assert found.maps.shape == (2, 4, 64, 64) and found.vectors.shape == (4, 512) and found.scores.shape == (4, 10)
    torch.testing.assert_close(found.scores, model.fc(found.vectors))
    raw = method.factorized(a.float(), "layer4")
    assert torch.equal(found.vectors, raw.vectors)

    peer_concepts, _ = DeepFeatureFactorization(model=model, target_layer=model.layer4)(x, n_components=4)[:2]
    offset = a.transpose(0, 1).reshape(a.shape[1], -1).amin(dim=1).numpy()

    def error(vectors: np.ndarray) -> float:  # the best maps for given vectors, by least squares (non-negative)
        from scipy.optimize import nnls

        basis = vectors - offset[:, None]
        residuals = [nnls(basis, column)[1] for column in shifted.numpy().T]
        return float(np.sqrt(np.sum(np.square(residuals))))

    assert error(found.vectors.double().numpy().T) <= 1.05 * error(peer_concepts)
    maps = explain.cam(model, x, "dff", "layer4", TARGETS, concepts=4, iterations=400, seed=0, resize=False)
    best = raw.scores[:, TARGETS].argmax(dim=0)
    torch.testing.assert_close(maps, raw.maps[[0, 1], best])

    from explain.io.render import concept_figure

    picture = concept_figure(np.zeros((64, 64, 3), np.uint8), found.maps[0], [f"c{k}" for k in range(4)], "DFF")
    assert picture.size[0] > 64 and len(np.unique(np.asarray(picture).reshape(-1, 3), axis=0)) > 4


def test_sess_is_pytorch_grad_cam_s_over_scaled_and_slid_windows() -> None:
    """SESS with Grad-CAM against pytorch-grad-cam's on a non-square image: its scales, overlapping windows, score
    weights, mean fusion above theta and blur; and refused for a target that is not a class."""
    from pytorch_grad_cam import SESS, GradCAM
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

    model = seeded("resnet18", num_classes=10)
    with torch.no_grad():
        model.fc.weight.mul_(10)  # class probabilities that differ between windows
    torch.manual_seed(1)
    x = torch.randn(2, 3, 48, 64)
    peer = SESS(model, [model.layer3], base_method=GradCAM, window_size=32, step_size=16, scales=[32, 48, 64])
    expected = torch.from_numpy(peer(input_tensor=x, targets=[ClassifierOutputTarget(t) for t in TARGETS])).float()
    got = explain.cam(model, x, "sess", "layer3", TARGETS, window=32, step=16, scales=[32, 48, 64])
    assert_same_picture(got, expected)
    with pytest.raises(explain.TargetError, match="classifier's class"):
        explain.cam(model, x, "sess", "layer3", lambda out: out[:, 0], window=32, scales=[32])
