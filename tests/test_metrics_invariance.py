"""Input invariance: the shifted copy gives the model's outputs exactly (zero padding included), gradients are
invariant and Input x Gradient is not (Kindermans et al.'s finding), equal to Quantus 0.6.0 where its copy is
exact (a first convolution without padding), and refused with the way out where no bias can absorb the shift."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import explain
from explain import metrics
from explain.errors import ExplainError


def _model(padding: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=padding), nn.ReLU(), nn.Conv2d(6, 8, 3, stride=2), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5),
    ).eval()  # fmt: skip


@pytest.mark.parametrize("padding", [0, 1, "same"])
def test_the_shifted_copy_gives_the_same_outputs_and_leaves_the_model(padding) -> None:
    model, x = _model(0), torch.randn(2, 3, 10, 10)
    model[0] = nn.Conv2d(3, 6, 3, padding=padding, bias=padding != 1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    shifted = metrics.shifted_model(model, x, -1.5, None)
    torch.testing.assert_close(shifted(x - 1.5), model(x), rtol=1e-5, atol=1e-5)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not model._forward_pre_hooks and not model[0]._forward_pre_hooks


def test_gradients_are_invariant_and_input_x_gradient_is_not() -> None:
    model, x = _model(1), torch.randn(3, 3, 10, 10)
    assert metrics.input_invariance(model, x, "saliency").all()
    assert not metrics.input_invariance(model, x, "input_x_gradient").any()
    assert metrics.input_invariance(model, x, "gradcam", layer="2").all()  # the layers after the first see alike


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_a_model_of_another_dtype_is_shifted_in_its_own(dtype: torch.dtype) -> None:
    """Float32 images are cast to the model's dtype, as every method casts them, and the copy's outputs are
    compared within that dtype's rounding (bfloat16's: a few of its steps, not float32's 1e-4)."""
    model, x = _model(1).to(dtype), torch.randn(3, 3, 10, 10)
    if dtype == torch.float64:
        assert metrics.input_invariance(model, x, "saliency").all()
    assert not metrics.input_invariance(model, x, "input_x_gradient").any()


@pytest.mark.parametrize(("method", "invariant"), [("saliency", True), ("input_x_gradient", False)])
def test_input_invariance_equals_quantus_where_its_copy_is_exact(method: str, invariant: bool) -> None:
    """Quantus' copy is exact for a first convolution without padding; its shift is replaced by one that moves
    every element."""
    quantus = pytest.importorskip("quantus")
    model, x = _model(0), torch.randn(3, 3, 10, 10)
    y = model(x).argmax(1).detach()

    def explained(model, inputs, targets, **kwargs):
        inputs = torch.as_tensor(inputs).float()
        return explain.create_method(method, model)(inputs, torch.as_tensor(targets)).cams[:, None].numpy()

    def shifted(arr, input_shift, **kwargs):
        """Every element shifted: Quantus' own shift leaves each image's first element as it was."""
        return arr + input_shift

    expected = quantus.InputInvariance(disable_warnings=True, perturb_func=shifted)(
        model=model, x_batch=x.numpy(), y_batch=y.numpy(), a_batch=None, channel_first=True,
        explain_func=explained, device="cpu",
    )  # fmt: skip
    found = metrics.input_invariance(model, x, method, y)
    np.testing.assert_array_equal(found.numpy(), np.asarray(expected))
    assert bool(found.all()) == invariant and bool(found.any()) == invariant


def test_a_model_that_reads_the_input_before_a_layer_is_refused() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = _model(1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(x * 2.0)

    with pytest.raises(ExplainError, match="hands the input itself to a linear layer or a convolution"):
        metrics.input_invariance(Scaled(), torch.randn(1, 3, 10, 10))
