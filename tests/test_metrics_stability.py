"""Relative input, output and representation stability and continuity: Grad-CAM's maps of perturbed or translated
copies against Quantus 0.6.0 on the same model, images and noise (Quantus' draws recorded and passed), and the
rules Quantus does not follow (a copy the model classifies otherwise is left out, not the whole image lost)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_metrics_faithfulness import tiny_model

import explain
from explain import metrics
from explain.errors import ExplainError

quantus = pytest.importorskip("quantus")

N, SAMPLES = 3, 4


def _explained(gradcam):
    def explained(model, inputs, targets, **kwargs):
        return gradcam(torch.as_tensor(inputs), torch.as_tensor(targets)).cams[:, None].numpy()

    return explained


def _recorded_uniform(monkeypatch) -> list[np.ndarray]:
    drawn, uniform = [], np.random.uniform

    def recorded(*args, **kwargs):
        drawn.append(uniform(*args, **kwargs))
        return drawn[-1]

    monkeypatch.setattr(np.random, "uniform", recorded)
    return drawn


@pytest.mark.parametrize(
    ("metric", "view", "options"),
    [("RelativeInputStability", "input", {}), ("RelativeOutputStability", "output", {}),
     ("RelativeRepresentationStability", "representation", {"layer_names": ["2"]})],
)  # fmt: skip
def test_relative_stability_equals_quantus_on_its_own_noise(monkeypatch, metric: str, view: str, options) -> None:
    model = tiny_model(3)
    torch.manual_seed(6)
    x = torch.randn(N, 3, 12, 12)
    target = model(x).argmax(1).detach()
    gradcam = explain.GradCAM(model, "2")
    plain = gradcam(x, target).cams
    drawn = _recorded_uniform(monkeypatch)
    expected = getattr(quantus, metric)(nr_samples=SAMPLES, disable_warnings=True, **options)(
        model=model, x_batch=x.numpy(), y_batch=target.numpy(), a_batch=plain[:, None].numpy(), channel_first=True,
        explain_func=_explained(gradcam), device="cpu",
    )  # fmt: skip
    assert not np.isnan(expected).any()  # no copy changed the prediction
    noise = torch.from_numpy(np.stack(drawn, axis=1)).float().view(N, SAMPLES, 3, 12, 12)
    layer = {"layer": "2"} if view == "representation" else {}
    found = metrics.relative_stability(gradcam, x, target, relative_to=view, perturbations=noise, **layer)
    np.testing.assert_allclose(found.numpy(), np.asarray(expected), rtol=1e-3)


def test_a_copy_classified_otherwise_is_left_out_and_the_model_is_needed() -> None:
    """A linear 'explainer' (the input itself) over noise on the decision boundary: the copies that flip the
    class do not count; with every copy flipped, NaN; a callable explainer needs model=."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 2)).eval()
    x = torch.randn(2, 1, 2, 2)
    logits = model(x)
    noise = torch.randn(2, 6, 1, 2, 2)
    with torch.no_grad():
        flipped = model((x[:, None] + noise).flatten(0, 1)).argmax(1).view(2, 6) != logits.argmax(1, keepdim=True)
    explainer = lambda images, classes: images[:, 0] ** 2 + 1  # noqa: E731
    found = metrics.relative_input_stability(explainer, x, model=model, perturbations=noise)
    e, e_moved = x[:, 0].flatten(1) ** 2 + 1, ((x[:, None] + noise)[:, :, 0].flatten(2)) ** 2 + 1
    ratio = ((e[:, None] - e_moved) / e[:, None]).norm(dim=2) / ((noise.flatten(2)) / x.flatten(1)[:, None]).norm(dim=2)
    expected = torch.where(flipped, -torch.inf, ratio).amax(1)
    assert flipped.any() and not flipped.all()
    torch.testing.assert_close(found, torch.where(expected.isinf(), torch.nan, expected), equal_nan=True)
    with pytest.raises(ExplainError, match="pass model="):
        metrics.relative_input_stability(explainer, x, perturbations=noise)


def test_continuity_equals_quantus_and_translations_move_the_image() -> None:
    model = tiny_model(3)
    torch.manual_seed(7)
    x = torch.randn(N, 3, 12, 12)
    target = model(x).argmax(1).detach()
    gradcam = explain.GradCAM(model, "2")
    per_map = {"normalise_axes": (1, 2, 3)}  # each map divided by its own largest
    expected = quantus.Continuity(nr_steps=6, disable_warnings=True, normalise_func_kwargs=per_map)(
        model=model, x_batch=x.numpy(), y_batch=target.numpy(), a_batch=None, channel_first=True,
        explain_func=_explained(gradcam), device="cpu",
    )  # fmt: skip
    found = metrics.continuity(gradcam, x, target, steps=6)  # shifts -8, -4, 0, 4, 8, 12
    assert np.isfinite(expected).all() and bool((found > 0).all())
    np.testing.assert_allclose(found.numpy(), np.asarray(expected), rtol=1e-4)
    moved = metrics.translations(x, [3, -2])
    least = x.amin(dim=(1, 2, 3)).view(N, 1, 1, 1)
    torch.testing.assert_close(moved[:, 0, ..., 3:], x[..., :9])
    torch.testing.assert_close(moved[:, 0, ..., :3], least.expand(N, 3, 12, 3))
    torch.testing.assert_close(moved[:, 1, ..., :10], x[..., 2:])
