"""Concepts: the factorization against scikit-learn, Sobol indices against closed forms, CRAFT on planted concepts,
and the layer read and rewritten through the engine on CNNs, ViTs and Swin."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import seeded, vgg_with_norms
from sklearn.decomposition import NMF
from test_speedups import hf_swin, small_cnn, small_vit
from torch import nn

from explain.concepts import Craft
from explain.concepts.factorization import coefficients, factorize
from explain.concepts.reading import LayerReader
from explain.concepts.sobol import jansen_total, sobol_design
from explain.errors import ExplainError, LayerError, TargetError


def batches_of(a: torch.Tensor, size: int):
    return lambda: iter(a.split(size))


def test_sobol_total_indices_of_ishigami_match_closed_forms() -> None:
    """Ishigami's function, f = sin x1 + a sin² x2 + b x3⁴ sin x1 on [-π, π]³: its total indices are known in
    closed form (Sobol' & Levitan 1999; Saltelli et al. 2010)."""
    a, b, designs = 7.0, 0.1, 2**13
    points = -math.pi + 2 * math.pi * sobol_design(3, designs, seed=1)
    x1, x2, x3 = points.unbind(dim=1)
    f = torch.sin(x1) + a * torch.sin(x2) ** 2 + b * x3**4 * torch.sin(x1)
    variance = a**2 / 8 + b * math.pi**4 / 5 + b**2 * math.pi**8 / 18 + 0.5
    v1 = 0.5 * (1 + b * math.pi**4 / 5) ** 2
    v13 = 8 * b**2 * math.pi**8 / 225
    expected = torch.tensor([v1 + v13, a**2 / 8, v13], dtype=torch.float64) / variance
    found = jansen_total(f, 3)
    assert (found.indices - expected).abs().max() < 0.01, (found.indices, expected)
    low, high = found.interval()
    assert bool(((low <= expected + 0.01) & (expected - 0.01 <= high)).all())


def test_nmf_matches_scikit_learn_and_streaming_changes_nothing() -> None:
    """The same rank and iterations as scikit-learn's NMF (multiplicative updates from NNDSVDa): the reconstruction
    error within 1%; the activations in batches of 7 rows or in one give the same factors."""
    generator = torch.Generator().manual_seed(0)
    a = torch.rand(120, 6, generator=generator, dtype=torch.float64) @ torch.rand(6, 40, generator=generator).double()
    a = a + 0.05 * torch.rand(a.shape, generator=generator, dtype=torch.float64)
    theirs = NMF(n_components=6, init="nndsvda", solver="mu", max_iter=100, tol=0.0).fit(a.numpy())
    ours = factorize(batches_of(a, len(a)), 6, 100, tol=0.0)
    assert abs(ours.error - theirs.reconstruction_err_) <= 0.01 * theirs.reconstruction_err_
    assert ours.error == pytest.approx(float((a - ours.coefficients @ ours.bank).norm()), rel=1e-9)
    streamed = factorize(batches_of(a, 7), 6, 100, tol=0.0)
    torch.testing.assert_close(streamed.bank, ours.bank)
    torch.testing.assert_close(streamed.coefficients, ours.coefficients)


def test_semi_nmf_fits_signed_activations_and_nmf_refuses_them() -> None:
    generator = torch.Generator().manual_seed(1)
    u = torch.rand(200, 4, generator=generator, dtype=torch.float64)
    w = torch.randn(4, 24, generator=generator, dtype=torch.float64)
    a = u @ w
    found = factorize(batches_of(a, 50), 4, 300, signed=True)
    assert bool((found.coefficients >= 0).all()) and found.error / float(a.norm()) < 0.02
    fitted = coefficients(a, found.bank, 300, signed=True)
    assert float((a - fitted @ found.bank).norm() / a.norm()) < 0.02
    with pytest.raises(ExplainError, match="semi-NMF"):
        factorize(batches_of(a, 50), 4, 10)


class Planted(nn.Module):
    """A model whose layer ``mix`` sees a non-negative mixture of K planted directions: its input's K channels are
    the mixture's coefficients at each position, ``mix`` a 1x1 convolution whose weights are the directions, and
    the head scores class 0 as the coefficients' mean weighed by ``weights``."""

    def __init__(self, directions: torch.Tensor, weights: torch.Tensor) -> None:
        super().__init__()
        k, c = directions.shape
        self.mix = nn.Conv2d(k, c, 1, bias=False)
        self.mix.weight.data = directions.T[..., None, None].float()
        self.head = nn.Linear(c, 2, bias=False)
        back = torch.linalg.pinv(directions.T.double())  # (K, C): from a position's features to its coefficients
        self.head.weight.data = torch.stack([weights.double() @ back, -(weights.double() @ back)]).float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mix(x).mean(dim=(2, 3)))


def planted_images(count: int, k: int, side: int, generator: torch.Generator) -> torch.Tensor:
    """Images of K coefficient channels: a grid of 4x4 cells, each cell one concept's at a random strength."""
    cells = side // 4
    which = torch.randint(0, k, (count, cells, cells), generator=generator)
    strength = 0.5 + torch.rand(count, cells, cells, generator=generator)
    coarse = torch.nn.functional.one_hot(which, k).permute(0, 3, 1, 2).float() * strength[:, None]
    return coarse.repeat_interleave(4, dim=2).repeat_interleave(4, dim=3)


def test_craft_recovers_planted_concepts_and_ranks_them_as_the_classifier_weighs_them() -> None:
    """The bank recovers each planted direction (cosine >= 0.95); the score is additive in the masked coefficients,
    so each concept's total index is its share of the score's variance, w_k² ū_k² / Σ_j w_j² ū_j² per image (the
    masks' variance cancels), averaged over the images."""
    generator = torch.Generator().manual_seed(0)
    k, channels = 4, 12
    directions = torch.eye(k).repeat_interleave(3, dim=1) + 0.3 * torch.rand(k, channels, generator=generator)
    weights = torch.tensor([3.0, 0.4, 1.5, 0.8])
    model = Planted(directions, weights).eval()
    images = planted_images(12, k, 32, generator)
    craft = Craft(model, "mix", concepts=k, crop=4, iterations=300)
    bank = craft.fit(images)
    assert not bank.signed and bank.layer == "mix" and bank.error < 0.01
    unit = torch.nn.functional.normalize
    cosine = unit(bank.bank.float(), dim=1) @ unit(directions, dim=1).T
    matched = cosine.argmax(dim=1)
    assert sorted(matched.tolist()) == list(range(k)) and bool((cosine.amax(dim=1) >= 0.95).all()), cosine
    importance = craft.importance(bank, images[:4], target=0, designs=64)
    shares = (weights * images[:4].mean(dim=(2, 3))) ** 2
    expected = (shares / shares.sum(dim=1, keepdim=True)).mean(dim=0)[matched].double()
    assert (importance.indices - expected).abs().max() < 0.05, (importance.indices, expected)
    assert matched[importance.ranking].tolist() == weights.argsort(descending=True).tolist()
    assert bool((importance.low <= importance.indices).all() and (importance.indices <= importance.high).all())
    maps = craft.maps(bank, images[:2], resize=False)  # each concept lies where its planted coefficient does
    maps = maps / maps.amax(dim=(0, 2, 3), keepdim=True)
    assert bool(((maps > 0.2) == (images[:2, matched] > 0)).float().mean() > 0.95)


@pytest.mark.parametrize("family", ["cnn", "vit", "swin"])
def test_a_layer_rewritten_with_its_own_output_scores_as_the_plain_pass(family: str) -> None:
    """Reading a layer's output as maps and putting the maps back in its place (a ViT's prefix tokens kept, Swin's
    channels last) changes nothing: the target's score is the plain pass's."""
    model = {"cnn": small_cnn, "vit": small_vit, "swin": hf_swin}[family]()
    x = torch.randn(3, 3, 64, 64, generator=torch.Generator().manual_seed(2))
    reader = LayerReader(model)
    reading = reader.read(x, 1)
    again = reader.rescored(x, reading, reading.activations, torch.arange(3), batch_size=2)
    torch.testing.assert_close(again, reading.scores, rtol=1e-4, atol=1e-5)
    halved = reader.rescored(x, reading, reading.activations * 0.5, torch.arange(3), batch_size=2)
    assert not torch.allclose(halved, reading.scores)


def test_craft_on_a_vit_finds_signed_concepts_with_finite_importance() -> None:
    model = small_vit()
    images = torch.randn(4, 3, 64, 64, generator=torch.Generator().manual_seed(3))
    craft = Craft(model, "blocks.0", concepts=3, crop=32, iterations=50, batch_size=8)
    bank = craft.fit(images)
    assert bank.signed and bank.bank.shape == (3, 192)
    importance = craft.importance(bank, images[:2], target=1, designs=8)
    assert bool(torch.isfinite(importance.indices).all()) and importance.per_image.shape == (2, 3)
    assert craft.maps(bank, images[:1]).shape == (1, 3, 64, 64)


def test_bad_requests_are_one_line_errors() -> None:
    model = small_cnn()
    images = torch.rand(2, 3, 32, 32)
    with pytest.raises(ExplainError, match="crops for 40 concepts"):
        Craft(model, concepts=40, crop=16).fit(images)
    with pytest.raises(ExplainError, match="does not fit"):
        Craft(model, concepts=2, crop=64).fit(images)
    with pytest.raises(LayerError):
        Craft(model, "8", concepts=2, crop=None).fit(images)  # the head's linear layer: no map of the input


def zennit_conditioned(model: nn.Module, x: torch.Tensor, targets: list[int], layer: str, mask: torch.Tensor):
    """CRP's definition with zennit: its EpsilonPlus composite with batch norms merged, the relevance arriving at
    ``layer`` multiplied by ``mask`` (C,) by a hook registered after the composite's, as zennit-crp conditions it."""
    from zennit.attribution import Gradient
    from zennit.canonizers import SequentialMergeBatchNorm
    from zennit.composites import EpsilonPlus

    module = model.get_submodule(layer)
    with Gradient(model=model, composite=EpsilonPlus(canonizers=[SequentialMergeBatchNorm()])) as attributor:
        handle = module.register_forward_hook(
            lambda m, i, o: o.register_hook(lambda g: g * mask.view(1, -1, 1, 1)) and None
        )
        try:
            _, relevance = attributor(x, torch.eye(10)[targets])
        finally:
            handle.remove()
    return relevance.sum(dim=1)


def test_crp_is_zennit_s_lrp_with_the_layer_s_relevance_masked_and_its_concepts_sum_to_the_whole() -> None:
    pytest.importorskip("zennit", reason="zennit: a test dependency (pip install -e '.[test]')")
    from explain.concepts import ConceptRelevance
    from explain.methods import LRP

    model = vgg_with_norms()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    partition = [list(range(0, 40)), list(range(40, 90)), list(range(90, 128))]
    found = ConceptRelevance(model, "features.4", [*partition, [5, 17]])(x, [1, 7])
    assert found.maps.shape == (2, 4, 32, 32) and found.layer == "features.4"
    for k, channels in enumerate([*partition, [5, 17]]):
        mask = torch.zeros(128)
        mask[channels] = 1.0
        expected = zennit_conditioned(model, x, [1, 7], "features.4", mask)
        assert expected.abs().max() > 0
        torch.testing.assert_close(found.maps[:, k], expected, rtol=1e-4, atol=1e-5 * float(expected.abs().max()))
    whole = LRP(model)(x, [1, 7], normalize=False).raw.sum(dim=1)
    torch.testing.assert_close(found.maps[:, :3].sum(dim=1), whole, rtol=1e-4, atol=1e-5 * float(whole.abs().max()))
    torch.testing.assert_close(found.relevance, found.maps.flatten(2).sum(dim=2))


def test_crp_through_a_concept_bank_splits_the_relevance_whole() -> None:
    from explain.concepts import ConceptRelevance
    from explain.methods import LRP

    model = small_cnn()
    images = torch.rand(8, 3, 32, 32, generator=torch.Generator().manual_seed(4))
    bank = Craft(model, "5", concepts=3, crop=None, iterations=100).fit(images)
    assert not bank.signed
    found = ConceptRelevance(model, concepts=bank)(images[:2], 1)
    whole = LRP(model)(images[:2], 1, normalize=False).raw.sum(dim=1)
    assert found.maps.shape == (2, 3, 32, 32) and found.layer == "5"
    torch.testing.assert_close(found.maps.sum(dim=1), whole, rtol=1e-4, atol=1e-5 * float(whole.abs().max()))
    with pytest.raises(ExplainError, match="signed"):
        ConceptRelevance(model, concepts=Craft(model, "3", concepts=2, crop=None, iterations=20).fit(images))


class Gated(nn.Module):
    """A model whose layer ``mix`` holds planted concepts (each owns three channels), a gate that passes a channel
    only where it is strong, so that the gradient at ``mix`` varies with the image, and a head that scores class 0
    up on concept 0's channels and down on the others'."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(5)
        directions = torch.eye(4).repeat_interleave(3, dim=1) + 0.3 * torch.rand(4, 12, generator=generator)
        self.mix = nn.Conv2d(4, 12, 1, bias=False)
        self.mix.weight.data = directions.T[..., None, None]
        self.head = nn.Linear(12, 2, bias=False)
        up = torch.tensor([1.0] * 3 + [-0.3] * 9)
        self.head.weight.data = torch.stack([up, -up])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mix(x) - 0.6).mean(dim=(2, 3)))


def test_t_test_is_scipy_s() -> None:
    stats = pytest.importorskip("scipy.stats")
    from explain.concepts.tcav import t_test

    generator = torch.Generator().manual_seed(0)
    for shift, sizes in [(0.0, (10, 10)), (0.4, (12, 7)), (2.0, (5, 9)), (0.05, (40, 40))]:
        a = torch.randn(sizes[0], generator=generator, dtype=torch.float64)
        b = torch.randn(sizes[1], generator=generator, dtype=torch.float64) + shift
        assert t_test(a, b) == pytest.approx(stats.ttest_ind(a.numpy(), b.numpy()).pvalue, rel=1e-9, abs=1e-15)


@pytest.mark.parametrize("fit", ["linear", "mean"])
def test_tcav_scores_a_planted_concept_near_1_and_a_random_one_near_half_not_significantly(fit: str) -> None:
    from explain.concepts import TCAV

    generator = torch.Generator().manual_seed(6)
    model = Gated().eval()
    images = planted_images(24, 4, 16, generator)
    striped = planted_images(12, 4, 16, generator)
    striped[:, 0] = striped.sum(dim=1)  # every cell concept 0's
    striped[:, 1:] = 0
    random = planted_images(24, 4, 16, generator)
    tcav = TCAV(model, "mix", fit=fit, runs=12)
    planted = tcav(images, striped, random, target=0)
    assert planted.score >= 0.95 and planted.significant and planted.layer == "mix", planted
    chance = tcav(images, random[:12], random[12:], target=0)
    assert 0.2 <= float(chance.scores.mean()) <= 0.8 and not chance.significant, chance


def test_tcav_is_captum_s_with_the_same_concept_vector(tmp_path) -> None:
    """Captum's TCAV, given our CAV through its classifier interface, counts the same share of images."""
    from captum.concept import TCAV as CaptumTCAV
    from captum.concept import Concept
    from captum.concept._utils.classifier import Classifier
    from captum.concept._utils.data_iterator import dataset_to_dataloader

    from explain.concepts import TCAV, cav

    generator = torch.Generator().manual_seed(7)
    model = small_cnn()
    images, concept, random = (torch.rand(n, 3, 32, 32, generator=generator) for n in (16, 8, 8))
    scale, shift = (torch.rand(16, 3, 1, 1, generator=generator) for _ in range(2))
    images = images * 3 * scale - 1.5 * shift  # colours far apart: the images' gradients point apart
    concept[:, 0] += 1.0  # redder
    ours = TCAV(model, "3")
    vector = cav(ours.activations(concept), ours.activations(random), "standardized").float()

    class Given(Classifier):
        def __init__(self) -> None:
            pass

        def train_and_eval(self, dataloader, **kwargs):
            return {"accs": torch.tensor(1.0)}

        def weights(self) -> torch.Tensor:
            return torch.stack([vector, -vector])

        def classes(self) -> list[int]:
            return [0, 1]

    def concept_of(index: int, name: str, data: torch.Tensor) -> Concept:
        return Concept(index, name, dataset_to_dataloader(torch.utils.data.TensorDataset(data)))

    sets = [[concept_of(0, "red", concept), concept_of(1, "random", random)]]
    peer = CaptumTCAV(model, ["3"], classifier=Given(), save_path=str(tmp_path))
    theirs = peer.interpret(images, sets, target=1)["0-1"]["3"]["sign_count"][0]
    derivatives = ours.gradients(images, 1).double() @ vector.double()
    assert float(theirs) == pytest.approx(float((derivatives > 0).double().mean()))
    assert 0 < float(theirs) < 1, "the images must split, or the comparison would be trivially 0 or 1"


class Batched(nn.Module):
    """A model that reads its batch size off its input and reshapes by it after the layer ``mix``: a forward that
    copies of one image cannot share (its tail sees one row where there are many)."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Conv2d(3, 6, 3, padding=1)
        self.head = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        return self.head(torch.relu(self.mix(x)).reshape(rows, 6, -1).mean(dim=2))


@pytest.mark.parametrize("make", [small_cnn, Batched, small_vit])
def test_copies_of_one_image_share_their_prefix_where_it_scores_the_same(make, monkeypatch) -> None:
    """Copies of one image with their layer output replaced score the same whether they share the image's forward
    up to the layer (the tails speedup) or run whole; the CNN and the ViT share it (their first layer sees the image
    once), the model that reshapes by its input's batch size does not."""
    model = make().eval()
    layer = {"Batched": "mix", "Sequential": "3", "VisionTransformer": "blocks.0"}[type(model).__name__]
    side = 64 if make is small_vit else 16
    x = torch.randn(1, 3, side, side, generator=torch.Generator().manual_seed(8))
    reader = LayerReader(model, layer)
    reading = reader.read(x, 1)
    noise = 1 + 0.3 * torch.randn(7, *reading.activations.shape[1:], generator=torch.Generator().manual_seed(9))
    maps, images = reading.activations * noise, torch.zeros(7, dtype=torch.long)
    seen: list[int] = []
    first = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
    handle = first.register_forward_pre_hook(lambda m, args: seen.append(len(args[0])) and None)
    try:
        shared = reader.rescored(x, reading, maps, images, batch_size=4)
        shared_batches = list(seen)
        monkeypatch.setenv("EXPLAIN_SPEEDUPS", "0")
        seen.clear()
        whole = reader.rescored(x, reading, maps, images, batch_size=4)
    finally:
        handle.remove()
    assert seen == [4, 3]
    torch.testing.assert_close(shared, whole, rtol=1e-4, atol=1e-5)
    # Batched fails shared and runs whole; the others' 7 copies fit in one shared run (tails.SHARED_ELEMENTS), after
    # which the first two (CHECKED) run whole once, to check the sharing
    assert shared_batches == {Batched: [1, 4, 3], small_cnn: [1, 2], small_vit: [1, 2]}[make]


@pytest.mark.parametrize("fit", ["linear", "standardized"])
def test_the_linear_cav_is_scikit_learn_s_regularized_logistic_regression(fit: str) -> None:
    """Our Newton steps on the representer reach scikit-learn's optimum of the same objective: mean log-loss plus
    λ‖w‖² is its C Σ log-loss + ½‖w‖² with C = 1 / (2 λ n); on the activations as they are (the paper's CAV, and
    Captum's), or on standardized features with the weights brought back. Features of very different spreads make
    the two directions differ."""
    from sklearn.linear_model import LogisticRegression

    from explain.concepts import cav

    generator = torch.Generator().manual_seed(10)
    spread = torch.logspace(-1, 1, 200, dtype=torch.float64)
    concept = (torch.randn(30, 200, generator=generator, dtype=torch.float64) + 0.3) * spread
    counter = torch.randn(40, 200, generator=generator, dtype=torch.float64) * spread
    ours = cav(concept, counter, fit, l2=0.01)
    data = torch.cat([concept, counter])
    scale = data.std(dim=0) if fit == "standardized" else torch.ones(200, dtype=torch.float64)
    labels = [1] * 30 + [0] * 40
    theirs = LogisticRegression(C=1 / (2 * 0.01 * 70), tol=1e-10, max_iter=10_000)
    theirs.fit(((data - data.mean(dim=0)) / scale).numpy(), labels)
    expected = torch.from_numpy(theirs.coef_[0]) / scale
    assert float(ours @ expected / expected.norm()) > 0.9999
    other = cav(concept, counter, "standardized" if fit == "linear" else "linear", l2=0.01)
    assert float(ours @ other) < 0.99


@pytest.mark.parametrize("kind", ["pt", "npy", "safetensors", "object"])
def test_a_dictionary_from_a_file_maps_its_concepts_where_they_lie(kind: str, tmp_path) -> None:
    """The planted directions given as a dictionary (a file, or an object with get_dictionary as overcomplete's):
    each concept's map lies where its planted coefficient does."""
    from explain.concepts import dictionary_bank

    generator = torch.Generator().manual_seed(11)
    directions = torch.eye(4).repeat_interleave(3, dim=1) + 0.3 * torch.rand(4, 12, generator=generator)
    model = Planted(directions, torch.ones(4)).eval()
    images = planted_images(2, 4, 16, generator)
    if kind == "object":
        source = type("Dictionary", (), {"get_dictionary": lambda self: directions})()
    elif kind == "npy":
        source = tmp_path / "d.npy"
        np.save(source, directions.numpy())
    elif kind == "safetensors":
        from safetensors.torch import save_file

        source = tmp_path / "d.safetensors"
        save_file({"dictionary": directions, "bias": torch.zeros(12)}, str(source))
    else:
        source = tmp_path / "d.pt"
        torch.save({"weights": directions}, source)
    bank = dictionary_bank(source, "mix")
    maps = Craft(model, "mix").maps(bank, images, resize=False)
    maps = maps / maps.amax(dim=(0, 2, 3), keepdim=True)
    assert not bank.signed and bool(((maps > 0.2) == (images > 0)).float().mean() > 0.95)


def test_a_dictionary_that_does_not_fit_is_refused_in_one_line(tmp_path) -> None:
    from explain.concepts import dictionary_bank

    with pytest.raises(ExplainError, match="no such dictionary file"):
        dictionary_bank(tmp_path / "missing.pt", "mix")
    (tmp_path / "two.pt").write_bytes(b"")
    torch.save({"a": torch.ones(2, 3), "b": torch.ones(3, 4)}, tmp_path / "two.pt")
    with pytest.raises(ExplainError, match="no single 2-D tensor"):
        dictionary_bank(tmp_path / "two.pt", "mix")
    with pytest.raises(ExplainError, match="negative entries"):
        dictionary_bank(-torch.ones(2, 3), "mix", signed=False)
    wrong = dictionary_bank(torch.rand(3, 5), "mix")
    model = Planted(torch.rand(4, 12), torch.ones(4)).eval()
    with pytest.raises(ExplainError, match="of 5 channels and layer mix has 12"):
        Craft(model, "mix").maps(wrong, torch.rand(1, 4, 8, 8))


def test_craft_through_a_detector_finds_scores_and_maps_concepts() -> None:
    """A Faster R-CNN's backbone layer: the crops are read with no target, the importance is of each image's first
    detection (scored by its box's match in every masked forward), and the maps lie on the images."""
    from conftest import random_detector

    from explain.targets import DetectionTarget

    detector = random_detector(
        (128, 160), num_classes=5, min_size=128, max_size=192, box_score_thresh=0.3, box_detections_per_img=8
    )
    images = torch.rand(2, 3, 128, 160, generator=torch.Generator().manual_seed(12))
    craft = Craft(detector, "backbone.body.12", concepts=3, crop=64, iterations=50, batch_size=4)
    bank = craft.fit(images)
    assert bank.layer == "backbone.body.12" and len(bank.boxes) == 2 * 4 and bank.bank.shape[0] == 3
    importance = craft.importance(bank, images, DetectionTarget(score_threshold=0.3), designs=8)
    assert bool(torch.isfinite(importance.indices).all()) and importance.per_image.shape == (2, 3)
    assert float(importance.indices.max()) > 0
    maps = craft.maps(bank, images)
    assert maps.shape == (2, 3, 128, 160) and bool((maps >= 0).all()) and float(maps.amax()) > 0


def test_crp_through_a_vit_splits_its_relevance_whole() -> None:
    """CRP at a ViT block's tokens (channels on the last axis, the class token's too): channel sets that partition
    the 192 channels give maps that sum to LRP's."""
    from explain.concepts import ConceptRelevance
    from explain.methods import LRP

    model = small_vit()
    x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(13))
    found = ConceptRelevance(model, "blocks.0", [list(range(0, 64)), list(range(64, 192))])(x, 2)
    whole = LRP(model)(x, 2, normalize=False).raw.sum(dim=1)
    assert found.maps.shape == (1, 2, 64, 64) and float(whole.abs().max()) > 0
    torch.testing.assert_close(found.maps.sum(dim=1), whole, rtol=1e-4, atol=1e-5 * float(whole.abs().max()))


def _analytic_box(i: int, j: int) -> list[int]:
    """VGG-11's receptive field at ``features.10`` (conv 3x3, pool 2, conv 3x3, pool 2, conv 3x3, all padded by 1)
    of grid position (i, j), on a 64 x 64 input: input rows 4i - 7 to 4i + 10, clipped, and the same for columns."""
    low = [max(0, 4 * v - 7) for v in (i, j)]
    high = [min(63, 4 * v + 10) for v in (i, j)]
    return [low[0], low[1], high[0] - low[0] + 1, high[1] - low[1] + 1]


def test_a_layer_position_s_receptive_field_is_its_analytic_one() -> None:
    from explain.concepts.references import receptive_boxes

    model = vgg_with_norms()
    positions = torch.tensor([(i, j) for i in (0, 1, 7, 15) for j in (0, 5, 14, 15)])
    x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(2))
    boxes = receptive_boxes(model, "features.10", x, positions, channels_last=False)
    assert boxes.tolist() == [_analytic_box(i, j) for i, j in positions.tolist()]
    assert all(not m._forward_hooks and not m._backward_hooks for m in model.modules())


def zennit_layer_relevance(model: nn.Module, x: torch.Tensor, layer: str) -> torch.Tensor:
    """The relevance arriving at ``layer`` for each image's top class, by zennit's EpsilonPlus with batch norms
    merged (what zennit-crp ranks references by), (N, C, h, w)."""
    from zennit.attribution import Gradient
    from zennit.canonizers import SequentialMergeBatchNorm
    from zennit.composites import EpsilonPlus

    kept: list[torch.Tensor] = []
    module = model.get_submodule(layer)
    with torch.no_grad():
        top = model(x).argmax(dim=1)
    with Gradient(model=model, composite=EpsilonPlus(canonizers=[SequentialMergeBatchNorm()])) as attributor:
        handle = module.register_forward_hook(lambda m, i, o: o.register_hook(lambda g: kept.append(g)) and None)
        try:
            attributor(x, torch.eye(10)[top])
        finally:
            handle.remove()
    return kept[0]


def test_references_by_relevance_are_the_images_of_most_relevance_at_the_layer_cut_to_their_peak() -> None:
    pytest.importorskip("zennit", reason="zennit: a test dependency (pip install -e '.[test]')")
    from explain.concepts import ConceptRelevance

    model = vgg_with_norms()
    x = torch.randn(12, 3, 64, 64, generator=torch.Generator().manual_seed(6))
    concepts = [[0], [1, 2, 3], list(range(10, 40))]
    found = ConceptRelevance(model, "features.10", concepts).references(x, count=4, batch_size=5)
    relevance = zennit_layer_relevance(model, x, "features.10")
    for k, channels in enumerate(concepts):
        per_position = relevance[:, channels].sum(dim=1)  # (N, 16, 16)
        values = per_position.flatten(1).sum(dim=1)
        expected = values.topk(4)
        assert found.samples[k].tolist() == expected.indices.tolist()
        torch.testing.assert_close(found.values[k], expected.values, rtol=1e-3, atol=1e-4 * float(values.abs().max()))
        peaks = per_position[expected.indices].flatten(1).argmax(dim=1)
        assert found.boxes[k].tolist() == [_analytic_box(int(p) // 16, int(p) % 16) for p in peaks]
    crops = found.crops(x)
    top, left, height, width = found.boxes[2, 0].tolist()
    assert torch.equal(crops[2][0], x[int(found.samples[2, 0]), :, top : top + height, left : left + width])


def test_references_by_activation_are_the_images_of_highest_peak_and_a_bank_s_split_the_relevance() -> None:
    from explain.concepts import ConceptRelevance

    model = small_cnn()
    images = torch.rand(10, 3, 32, 32, generator=torch.Generator().manual_seed(8))
    kept: list[torch.Tensor] = []
    handle = model[5].register_forward_hook(lambda m, i, o: kept.append(o.detach()))
    with torch.no_grad():
        model(images)
    handle.remove()
    crp = ConceptRelevance(model, "5", [[0, 1], [2]])
    found = crp.references(images, count=3, by="activation", batch_size=4)
    for k, channels in enumerate([[0, 1], [2]]):
        peak = kept[0][:, channels].sum(dim=1).flatten(1).amax(dim=1)
        assert found.samples[k].tolist() == peak.topk(3).indices.tolist()
        torch.testing.assert_close(found.values[k], peak.topk(3).values)
    bank = Craft(model, "5", concepts=3, crop=None, iterations=100).fit(images)
    every = ConceptRelevance(model, concepts=bank).references(images, count=10)
    total = ConceptRelevance(model, "5", [list(range(kept[0].shape[1]))]).references(images, count=10)
    per_image = torch.zeros(10).index_add_(0, every.samples.flatten(), every.values.flatten())
    torch.testing.assert_close(per_image[total.samples[0]], total.values[0], rtol=1e-4, atol=1e-6)


def test_references_refuse_tokens_unknown_rankings_and_mixed_sizes_in_one_line() -> None:
    from explain.concepts import ConceptRelevance

    with pytest.raises(LayerError, match=r"^layer 'blocks.0' is no spatial map: .* name a convolutional layer$"):
        ConceptRelevance(small_vit(), "blocks.0", [[0]]).references(torch.randn(2, 3, 64, 64))
    crp = ConceptRelevance(small_cnn(), "5", [[0]])
    with pytest.raises(ExplainError, match=r"^references by 'gradient': rank them by relevance or activation$"):
        crp.references(torch.rand(2, 3, 32, 32), by="gradient")
    with pytest.raises(ExplainError, match=r"^references need images of one size: \(3, 16, 16\) after \(3, 32, 32\)$"):
        crp.references([torch.rand(2, 3, 32, 32), torch.rand(2, 3, 16, 16)])
    with pytest.raises(ExplainError, match=r"^no images to rank"):
        crp.references([])


def test_crp_through_a_detector_explains_one_box_and_its_concepts_sum_to_lrp_s_map() -> None:
    """A Faster R-CNN's backbone layer, each image's first detection explained (one box per image): channel sets
    that partition the layer's channels give maps that sum to LRP's map of that box; several boxes are refused."""
    from conftest import random_detector

    from explain.concepts import ConceptRelevance
    from explain.methods import LRP
    from explain.targets import DetectionTarget

    detector = random_detector(
        (128, 160), num_classes=5, min_size=128, max_size=192, box_score_thresh=0.3, box_detections_per_img=8
    )
    images = torch.rand(2, 3, 128, 160, generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        found = detector(images)
    first = DetectionTarget(boxes=[f["boxes"][:1] for f in found], labels=[f["labels"][:1] for f in found])
    crp = ConceptRelevance(detector, "backbone.body.12", [list(range(0, 40)), list(range(40, 112))])
    maps = crp(images, first)
    whole = LRP(detector)(images, first, normalize=False).raw[:, 0].sum(dim=1)
    assert maps.maps.shape == (2, 2, 128, 160) and float(whole.abs().max()) > 0
    scale = float(whole.abs().max())
    torch.testing.assert_close(maps.maps.sum(dim=1), whole, rtol=1e-4, atol=1e-5 * scale)
    assert not torch.allclose(maps.maps[:, 0], maps.maps[:, 1], atol=1e-3 * scale)
    with pytest.raises(TargetError, match=r"^CRP explains one target per image \(of a detector, one box"):
        crp(images, DetectionTarget(score_threshold=0.3))


def _factorize_on_rank(rank: int, init: str, rows: torch.Tensor, out: str) -> None:
    """One of two ranks (gloo): its half of the rows (every second one) factorized with the ranks' statistics."""
    import torch.distributed as dist

    from explain.concepts.ranks import Ranks

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        ranks = Ranks(rank, 2)
        found = {}
        for signed, data in ((False, rows.clamp_min(0)), (True, rows)):
            mine = data[rank::2]
            factors = factorize(lambda mine=mine: iter(mine.split(7)), 4, 60, signed=signed, ranks=ranks)
            found[signed] = (factors.bank, ranks.gathered(factors.coefficients, len(data)), factors.error)
        if rank == 0:
            torch.save(found, out)
    finally:
        dist.destroy_process_group()


def test_two_ranks_factorize_what_one_process_does(tmp_path) -> None:
    """NMF and semi-NMF of rows split between two processes: the same bank, coefficients and error as of all the
    rows in one process (the ranks add up the Gram matrix, the start's norms and mean, UᵀA and UᵀU)."""
    import torch.multiprocessing as mp

    rows = torch.randn(45, 12, generator=torch.Generator().manual_seed(21), dtype=torch.float64)
    out = tmp_path / "found.pt"
    mp.spawn(_factorize_on_rank, args=(f"file://{tmp_path / 'rendezvous'}", rows, str(out)), nprocs=2)
    found = torch.load(out)
    for signed, data in ((False, rows.clamp_min(0)), (True, rows)):
        alone = factorize(lambda data=data: iter(data.split(7)), 4, 60, signed=signed)
        bank, coefficients, error = found[signed]  # the coefficients gathered into the rows' own order
        torch.testing.assert_close(bank, alone.bank, rtol=1e-7, atol=1e-9)
        torch.testing.assert_close(coefficients, alone.coefficients, rtol=1e-7, atol=1e-9)
        assert abs(error - alone.error) < 1e-9 * alone.error


def test_crp_s_concepts_that_partition_a_resnet_layer_sum_to_its_lrp_map() -> None:
    """On a ResNet-18 (residual sums, merged batch norms): channel sets that partition ``layer3``'s 256 channels give
    maps that sum to LRP's map, and their relevances to LRP's relevance arriving at the layer."""
    from explain.concepts import ConceptRelevance
    from explain.methods import LRP

    model = seeded("resnet18", num_classes=10)
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(4))
    partition = [list(range(0, 100)), list(range(100, 180)), list(range(180, 256))]
    found = ConceptRelevance(model, "layer3", partition)(x, [1, 7])
    whole = LRP(model)(x, [1, 7], normalize=False).raw.sum(dim=1)
    assert whole.abs().max() > 0 and found.maps.abs().amax(dim=(0, 2, 3)).min() > 0
    torch.testing.assert_close(found.maps.sum(dim=1), whole, rtol=1e-4, atol=1e-4 * float(whole.abs().max()))
    at_layer = LRP(model, "layer3")(x, [1, 7], normalize=False).raw
    torch.testing.assert_close(found.relevance.sum(dim=1), at_layer.flatten(1).sum(1), rtol=1e-3, atol=1e-5)


class Curved(nn.Module):
    """Eight channels read as they are at ``mix`` (a 1x1 identity); class 0's score Σ w m + ½ Σ u m² of their means m:
    its gradient at ``mix`` is w + u m, so it varies with each image where u is not 0."""

    def __init__(self, w: torch.Tensor, u: torch.Tensor) -> None:
        super().__init__()
        self.mix = nn.Conv2d(8, 8, 1, bias=False)
        self.mix.weight.data = torch.eye(8)[..., None, None]
        self.w, self.u = w, u

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.mix(x).mean(dim=(2, 3))
        score = m @ self.w + 0.5 * (m**2) @ self.u
        return torch.stack([score, -score], dim=1)


def test_tcav_s_default_cav_gives_captum_s_default_score_where_a_standardized_fit_would_not(tmp_path) -> None:
    """The concept lies in two features of spread 1; six more of spread 0.01 are shifted a little (3 of their
    spreads), and the class falls along them. The paper's CAV (and Captum's default SGD classifier), on the
    activations as they are, points along the concept's two features: the class rises along it for the 25 of 40
    images whose two features are up. A standardized fit weighs the six faint features as much, and its CAV,
    brought back, points along them: the class falls for every image."""
    import numpy as np
    from captum.concept import TCAV as CaptumTCAV
    from captum.concept import Concept
    from captum.concept._utils.data_iterator import dataset_to_dataloader

    from explain.concepts import TCAV

    generator = torch.Generator().manual_seed(3)
    spread = torch.tensor([1.0, 1.0] + [0.01] * 6)[None, :, None, None]

    def drawn(count: int, shift: torch.Tensor) -> torch.Tensor:
        return torch.randn(count, 8, 2, 2, generator=generator) * spread + shift[None, :, None, None]

    concept = drawn(30, torch.tensor([3.0, 3.0] + [0.03] * 6))
    random = drawn(30, torch.zeros(8))
    images = drawn(40, torch.zeros(8)) * 0.1
    images[:, :2] += torch.tensor([1.0] * 25 + [-1.0] * 15)[:, None, None, None]
    model = Curved(torch.tensor([0.0, 0.0] + [-5.0] * 6), torch.tensor([1.0, 1.0] + [0.0] * 6)).eval()
    ours = TCAV(model, "mix", runs=4)(images, concept, random, target=0)
    standardized = TCAV(model, "mix", fit="standardized", runs=4)(images, concept, random, target=0)
    np.random.seed(0)  # Captum's classifier: scikit-learn's SGD, and its own train-test split
    torch.manual_seed(0)

    def concept_of(index: int, name: str, data: torch.Tensor) -> Concept:
        return Concept(index, name, dataset_to_dataloader(torch.utils.data.TensorDataset(data)))

    peer = CaptumTCAV(model, ["mix"], save_path=str(tmp_path))
    sets = [[concept_of(0, "concept", concept), concept_of(1, "random", random)]]
    theirs = float(peer.interpret(images, sets, target=0)["0-1"]["mix"]["sign_count"][0])
    assert theirs == pytest.approx(25 / 40, abs=0.05)
    assert ours.score == pytest.approx(theirs, abs=0.05)
    assert standardized.score < theirs - 0.5
