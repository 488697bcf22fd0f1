"""The explorer's concepts view: concepts found in its photos are CRAFT's, each photo's concepts listed by their
share of it, a concept drawn where it lies, its best crops, a bank found elsewhere, and the page's panel."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import CAT
from PIL import Image

import explain
from explain.concepts import ConceptBank, Craft
from explain.concepts.factorization import coefficients
from explain.errors import ExplainError
from explain.explorer import Explorer, bundled_photos
from explain.explorer.web import App
from explain.io.render import colorize


@pytest.fixture(scope="module")
def explored() -> Explorer:
    explorer = Explorer(explain.load_model("efficientnet_lite0"))
    for path in bundled_photos():
        explorer.add(path)
    explorer.concepts.find("bn2", concepts=5)
    return explorer


def _bn2(explorer: Explorer, photo: str) -> torch.Tensor:
    """The photo's activations at bn2 read by a plain forward hook, (positions, channels)."""
    model, found = explorer.spec.model, []
    handle = model.bn2.register_forward_hook(lambda m, i, out: found.append(out.detach()))
    try:
        with torch.no_grad():
            model(explorer.photos[photo].x)
    finally:
        handle.remove()
    return found[0][0].flatten(1).T.double()


def test_the_concepts_of_the_photos_are_craft_s_on_their_half_size_crops(explored) -> None:
    images = torch.cat([photo.x for photo in explored.photos.values()])
    direct = Craft(explored.spec.model, "bn2", concepts=5, crop=112).fit(images)
    bank = explored.concepts.bank
    assert bank.layer == "bn2" and len(bank.boxes) == 12  # 2 x 2 crops of 112 pixels (stride 89) of each photo
    torch.testing.assert_close(bank.bank, direct.bank)


def test_a_photo_lists_its_concepts_by_their_share_of_its_positions(explored) -> None:
    for photo in explored.photos:
        rows = _bn2(explored, photo).clamp_min(0)
        sums = coefficients(rows, explored.concepts.bank.bank).sum(dim=0)
        expected = (sums / sums.sum()).float()
        entries = explored.concepts.entries(photo)
        shares = torch.tensor([e.share for e in entries])
        assert sorted(e.index for e in entries) == list(range(5)) and bool((shares[:-1] >= shares[1:]).all())
        torch.testing.assert_close(shares, expected[[e.index for e in entries]], rtol=1e-4, atol=1e-5)
        assert entries[0].index == int(expected.argmax())  # the most present, far ahead of the rest
        assert entries[0].label.startswith(f"concept {entries[0].index} · ")


def test_a_concept_is_drawn_where_its_coefficients_peak_and_again_without_the_model(explored) -> None:
    explorer = Explorer(explored.spec)
    explorer.add(bundled_photos()[0])
    explorer.concepts.use(explored.concepts.bank)
    calls: list[int] = []
    handle = explored.spec.model.register_forward_hook(lambda *_: calls.append(1))
    try:
        top = explorer.concepts.entries("chelsea.jpg")[0].index
        picture = np.asarray(explorer.concepts.picture("chelsea.jpg", top, alpha=1.0, colormap="jet"))
        again = [explorer.concepts.picture("chelsea.jpg", k, 0.3, "gray") for k in range(5)]
    finally:
        handle.remove()
    assert calls == [1]  # the photo read once; every other concept, alpha and colormap from the kept maps
    photo = explored.photos["chelsea.jpg"].image
    assert picture.shape == (photo.size[1], photo.size[0], 3) and len(again) == 5
    rows = _bn2(explored, "chelsea.jpg").clamp_min(0)
    grid = coefficients(rows, explored.concepts.bank.bank)[:, top].reshape(7, 7)
    row, column = divmod(int(grid.argmax()), 7)  # its peak on the layer's grid, at the photo's pixels
    y, x = int((row + 0.5) * photo.size[1] / 7), int((column + 0.5) * photo.size[0] / 7)
    hottest = colorize(np.ones((1, 1), dtype=np.float32), "jet")[0, 0]
    assert np.abs(picture[y, x].astype(int) - hottest.astype(int)).max() <= 60  # the map's top colour there


def test_a_concept_s_best_crops_are_those_of_its_highest_coefficients(explored) -> None:
    bank = explored.concepts.bank
    best = int(bank.coefficients[:, 2].argmax())
    crops = explored.concepts.best_crops(2, count=3)
    assert [c.size for c in crops] == [(96, 96)] * 3
    image, top, left, side = bank.boxes[best].tolist()
    photo = list(explored.photos.values())[image].x[0]
    preprocessing = explored.spec.preprocessing  # the normalization the model was trained with, undone
    mean, std = torch.tensor(preprocessing.mean), torch.tensor(preprocessing.std)
    pixels = (photo[:, top : top + side, left : left + side] * std[:, None, None] + mean[:, None, None]).clamp(0, 1)
    expected = np.asarray(Image.fromarray((pixels * 255 + 0.5).byte().permute(1, 2, 0).numpy()).resize((96, 96)))
    assert np.abs(np.asarray(crops[0]).astype(int) - expected.astype(int)).mean() < 4


def test_a_bank_found_elsewhere_maps_the_photos_and_a_wrong_one_is_refused(explored) -> None:
    explorer = Explorer(explored.spec)
    explorer.add(CAT)
    with pytest.raises(ExplainError, match="no concepts yet: find them in the photos first"):
        explorer.concepts.entries("chelsea.png")
    explorer.concepts.use(explored.concepts.bank)
    assert len(explorer.concepts.entries("chelsea.png")) == 5 and explorer.concepts.best_crops(0) == []
    wrong = ConceptBank(torch.rand(3, 40, dtype=torch.float64), "bn2", False, torch.zeros(0, 4), torch.zeros(0, 3), 0)
    explorer.concepts.use(wrong)
    with pytest.raises(ExplainError, match="the concepts are of 40 channels and layer bn2 has 1280"):
        explorer.concepts.entries("chelsea.png")
    with pytest.raises(ExplainError, match="no concept 7: the bank has 3"):
        explorer.concepts.best_crops(7)
    with pytest.raises(ExplainError, match=r"^4 crops for 14 concepts: give more images, smaller crops or fewer"):
        explorer.concepts.find("bn2", concepts=14)  # 2 x 2 crops of the one photo


def test_the_page_s_panel_finds_lists_and_draws_concepts(explored) -> None:
    app = App(explored.spec, explain.load_model)
    menu, picture, crops, said = app_found(app)
    assert said.startswith("**4 concepts** at `bn2`, from 12 crops of 3 photos")
    assert [value for _, value in menu.choices] == [e.index for e in app.explorer.concepts.entries("chelsea.jpg")]
    assert menu.value == menu.choices[0][1] and picture.size == app.explorer.photos["chelsea.jpg"].image.size
    assert len(crops) == 6


def app_found(app: App) -> tuple:
    from explain.explorer.concept_panel import found

    return found(app, "chelsea.jpg", ["bn2"], 4, 0.5, "jet")
