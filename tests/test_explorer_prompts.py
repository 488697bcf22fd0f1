"""The explorer on structured outputs: a pose model's keypoints listed and picked by a click, a promptable
segmenter prompted by a click or a box, a depth model's region drawn as a box; each map against the direct call
of the same target."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import CAT
from PIL import Image

import explain
from explain.explorer import Explorer, View
from explain.io.render import BOX_COLOUR
from explain.models import UNIT_PREPROCESSING
from explain.models.sam import SamPrompted
from explain.targets import KeypointTarget, PromptMaskTarget, RegionTarget

transformers = pytest.importorskip("transformers")


def _cat(size: tuple[int, int] = (160, 120)) -> Image.Image:
    return Image.open(CAT).convert("RGB").resize(size)


def test_a_pose_models_keypoints_are_entries_and_a_click_picks_the_nearest() -> None:
    """Keypoint R-CNN: every keypoint of every detection is an entry, named for its keypoint, at its point; its
    map is KeypointTarget's of all keypoints, that entry's; a click beside a keypoint picks it; the photo to
    click draws the skeletons."""
    from test_keypoints import LAYER, built_pose_model

    model = built_pose_model()
    spec = explain.ModelSpec(model, "pose", ["__background__", "person"], UNIT_PREPROCESSING, "detection")
    explorer = Explorer(spec, score_threshold=0.05)
    photo = explorer.add(CAT)  # 451 x 300
    entries = explorer.entries(photo.name)
    result = explain.GradCAM(model, LAYER)(photo.x, KeypointTarget(score_threshold=0.05))
    shown = [k for _, k in result.shown()]
    assert len(entries) == len(shown) and len(entries) % 17 == 0 and len(entries) >= 17
    assert [e.class_name for e in entries[:17]] == list(explain.targets.COCO_KEYPOINTS)
    for place in (0, 9, len(entries) - 1):
        cam = explorer.show(photo.name, View(layers=(LAYER,), target=place)).cam
        torch.testing.assert_close(cam, result.cams[0, shown[place]].cpu(), atol=1e-5, rtol=0)
        point = tuple(result.target.points[0, shown[place]].tolist())  # the photo is the input: the same pixels
        assert entries[place].point == pytest.approx(point, abs=1e-4)
        picked = explorer.entry_at(photo.name, point[0] + 0.4, point[1] - 0.3)
        assert entries[picked].point == pytest.approx(point, abs=1e-4)
    pixels = np.asarray(explorer.clickable(photo.name))
    for x, y, _ in entries[0].pose:  # Keypoint R-CNN's keypoints are all visible: each is a dot
        column, row = min(max(round(x), 0), 450), min(max(round(y), 0), 299)
        assert (pixels[max(row - 1, 0) : row + 2, max(column - 1, 0) : column + 2] == BOX_COLOUR).all(axis=2).any()


def test_a_click_picks_the_smallest_detection_holding_it_and_a_classifier_has_none() -> None:
    from conftest import random_detector

    model = random_detector((160, 160))
    spec = explain.ModelSpec(model, "detector", [f"c{i}" for i in range(91)], UNIT_PREPROCESSING, "detection")
    explorer = Explorer(spec)
    photo = explorer.add(_cat((160, 160)), "cat.png")
    entries = explorer.entries(photo.name)
    assert entries
    for entry in entries[:3]:
        x1, y1, x2, y2 = entry.box
        centre = ((x1 + x2) / 2, (y1 + y2) / 2)
        holding = [e for e in entries if e.box[0] <= centre[0] <= e.box[2] and e.box[1] <= centre[1] <= e.box[3]]
        smallest = min(holding, key=lambda e: (e.box[2] - e.box[0]) * (e.box[3] - e.box[1]))
        assert explorer.entry_at(photo.name, *centre) == smallest.index
    outside = [(x, y) for x in range(0, 160, 4) for y in range(0, 160, 4) if not any(
        e.box[0] <= x <= e.box[2] and e.box[1] <= y <= e.box[3] for e in entries)]  # fmt: skip
    if outside:
        with pytest.raises(explain.ExplainError, match="nothing to explain at"):
            explorer.entry_at(photo.name, *outside[0])
    lite0 = Explorer(explain.load_model("efficientnet_lite0"))
    with pytest.raises(explain.ExplainError, match="click one in the list"):
        lite0.entry_at(lite0.add(CAT).name, 10, 10)


def test_a_promptable_segmenter_is_prompted_by_a_point_or_a_box() -> None:
    """SAM: the view's prompt is the point or box; its map is the direct call's with that prompt; without one, the
    error asks for a click; the photo to click draws the prompt."""
    from test_sam import _sam

    sam = _sam()
    spec = explain.ModelSpec(sam, "sam", ["mask"], UNIT_PREPROCESSING, "prompted")
    explorer = Explorer(spec)
    photo = explorer.add(_cat(), "cat.png")
    for prompt, keyword in (
        ((60.0, 40.0), {"points": [(60.0, 40.0)]}),
        ((20.0, 10.0, 90.0, 70.0), {"box": (20.0, 10.0, 90.0, 70.0)}),
    ):
        shown = explorer.show(photo.name, View(prompt=prompt))
        expected = explain.GradCAM(SamPrompted(sam, **keyword))(photo.x, PromptMaskTarget())
        torch.testing.assert_close(shown.cam, expected.cams[0].cpu(), atol=1e-5, rtol=0)
        assert shown.entry.class_name == "mask" and shown.entry.class_index == int(expected.class_indices[0])
        assert [e.index for e in explorer.entries(photo.name, View(prompt=prompt))] == [0]
    pixels = np.asarray(explorer.clickable(photo.name, View(prompt=(60.0, 40.0))))
    assert (pixels[40, 60] == BOX_COLOUR).all()
    with pytest.raises(explain.ExplainError, match=r"give the view a point \(x, y\) or a box"):
        explorer.show(photo.name, View())


def test_a_depth_models_region_is_the_box_drawn_on_the_photo() -> None:
    """A map model whose input squeezes the photo: the view's box in the photo's pixels is RegionTarget's box
    drawn on the photo's frame; no box: the whole photo; a box outside the photo is refused."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, stride=2, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(4, 1, 3, padding=1)
    ).eval()
    preprocessing = explain.models.Preprocessing(64, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    explorer = Explorer(explain.ModelSpec(model, "mine", ["depth"], preprocessing, "depth"))
    photo = explorer.add(_cat(), "cat.png")
    box = (40.0, 30.0, 120.0, 90.0)
    shown = explorer.show(photo.name, View(layers=("0",), prompt=box))
    expected = explain.GradCAM(model, "0")(photo.x, RegionTarget(box=box, size=(120, 160)))
    torch.testing.assert_close(shown.cam, expected.cams[0].cpu(), atol=1e-5, rtol=0)
    assert shown.entry.probability == pytest.approx(float(expected.probabilities[0]), rel=1e-6)
    whole = explorer.show(photo.name, View(layers=("0",)))
    expected = explain.GradCAM(model, "0")(photo.x, RegionTarget(mask=torch.ones(1, 1)))
    torch.testing.assert_close(whole.cam, expected.cams[0].cpu(), atol=1e-5, rtol=0)
    with pytest.raises(explain.ExplainError, match="the region lies outside the 120x160 image"):
        explorer.show(photo.name, View(layers=("0",), prompt=(100.0, 10.0, 200.0, 50.0)))


class _Click:
    """What Gradio hands a select handler: the clicked pixel of the image, (x, y)."""

    def __init__(self, x: float, y: float) -> None:
        self.index = [x, y]


def test_the_apps_clicks_prompt_a_point_a_box_and_pick_a_keypoint() -> None:
    """The page's click handler: a promptable segmenter's point, then a box from two corners (the first waiting
    for the second, sorted whichever comes first), each drawn as the explorer draws that prompt's view; a pose
    model's click picks the nearest keypoint."""
    pytest.importorskip("gradio")
    from test_keypoints import built_pose_model
    from test_sam import _sam

    from explain.explorer.web import App

    sam = _sam()
    app = App(explain.ModelSpec(sam, "sam", ["mask"], UNIT_PREPROCESSING, "prompted"), explain.load_model)
    photo = app.explorer.add(_cat(), "cat.png").name
    opened = app.opened(photo)  # the layers of the prompted model; no entry until a click; the photo to click
    automatic = [name for label, name in opened[1].choices if label.endswith("[automatic]")]
    assert automatic == ["model.vision_encoder.neck"] and opened[0].choices == [] and opened[-1].visible
    assert app.draw(photo, "gradcam", [], None, "mean", False, False, [], 0.5, "jet", None)[0] == ""  # no prompt
    target, prompt, corner, _ = app.clicked(photo, "point", None, None, [], _Click(60, 40))
    assert (target, prompt, corner) == (None, [60.0, 40.0], None)
    page, caption, _ = app.draw(photo, "gradcam", [], target, "mean", False, False, prompt, 0.5, "jet", None)
    assert caption.startswith("#0 mask") and "data:image/jpeg" in page
    shown = app.explorer.show(photo, View(prompt=(60.0, 40.0)))
    expected = explain.GradCAM(SamPrompted(sam, points=[(60.0, 40.0)]))(
        app.explorer.photos[photo].x, PromptMaskTarget()
    )
    torch.testing.assert_close(shown.cam, expected.cams[0].cpu(), atol=1e-5, rtol=0)
    _, prompt, corner, _ = app.clicked(photo, "box", None, None, prompt, _Click(90, 70))
    assert prompt == [60.0, 40.0] and corner == [90.0, 70.0]  # the first corner waits
    _, prompt, corner, _ = app.clicked(photo, "box", corner, None, prompt, _Click(20, 10))
    assert prompt == [20.0, 10.0, 90.0, 70.0] and corner is None
    assert app.listed(photo, None, prompt).choices[0][0].startswith("#0 mask")

    pose = built_pose_model()
    spec = explain.ModelSpec(pose, "pose", ["__background__", "person"], UNIT_PREPROCESSING, "detection")
    app = App(spec, explain.load_model)
    app.explorer.score_threshold = 0.05
    photo = app.explorer.add(CAT).name
    entry = app.explorer.entries(photo)[20]
    target, prompt, corner, picker = app.clicked(photo, "point", None, 0, [], _Click(*entry.point))
    assert app.explorer.entries(photo)[target].point == entry.point and prompt == [] and corner is None
    assert picker.visible and picker.value is not None


def test_the_page_prompts_a_sam_folder_by_clicks_in_a_browser(tmp_path) -> None:
    """``explain app --model FOLDER`` of a SAM: the photo to click is shown; a click on it draws the mask's map;
    switched to boxes, two clicks draw a box's map; the browser logs no error."""
    from test_explorer import BROWSER, DRIVER, free_port
    from test_sam import _sam

    if BROWSER is None or DRIVER is None:
        pytest.skip("chromium and chromedriver not installed")
    pytest.importorskip("gradio")
    import subprocess
    import sys
    import time
    import urllib.request

    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    folder = tmp_path / "sam"
    _sam().save_pretrained(folder)
    port, log = free_port(), tmp_path / "log"
    with open(log, "w") as out:
        command = [sys.executable, "-m", "explain", "app", "--model", str(folder), "--port", str(port), "--quiet"]
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path)
    options = webdriver.ChromeOptions()
    options.binary_location = BROWSER
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1400,1000"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    browser = None
    try:
        for _ in range(240):
            assert server.poll() is None, log.read_text()
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        browser = webdriver.Chrome(service=Service(DRIVER), options=options)
        wait = WebDriverWait(browser, 120)
        browser.get(f"http://127.0.0.1:{port}/")

        def caption() -> str:
            return browser.find_element(By.ID, "caption").text

        def overlay() -> str | None:
            found = browser.find_elements(By.CSS_SELECTOR, "#overlay img.heat")
            return found[0].get_attribute("src") if found else None

        picker = wait.until(lambda _: browser.find_elements(By.CSS_SELECTOR, "#picker img"), "the photo to click")[0]
        wait.until(lambda _: "Click the photo to prompt" in caption(), "the prompt asked for")
        ActionChains(browser).move_to_element_with_offset(picker, -20, -10).click().perform()
        wait.until(lambda _: caption().startswith("#0 mask") and overlay(), "the point's mask explained")
        shown = overlay()
        browser.find_element(By.CSS_SELECTOR, "#click input[value=box]").click()
        for dx, dy in ((-60, -40), (40, 30)):
            picker = browser.find_element(By.CSS_SELECTOR, "#picker img")
            ActionChains(browser).move_to_element_with_offset(picker, dx, dy).click().perform()
            time.sleep(0.5)
        wait.until(lambda _: overlay() and overlay() != shown, "the box's mask explained")
        errors = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
        assert not errors, errors
    finally:
        if browser is not None:
            browser.quit()
        server.terminate()
        server.wait(30)


def test_the_notebook_explorer_takes_a_typed_prompt() -> None:
    """The notebook explorer of a SAM: no map until a prompt is typed; a point, then a box, each drawn as the
    explorer draws that prompt's view; a malformed prompt is named, the overlay kept."""
    pytest.importorskip("ipywidgets")
    from test_sam import _sam

    from explain.notebook import explore

    sam = _sam()
    spec = explain.ModelSpec(sam, "sam", ["mask"], UNIT_PREPROCESSING, "prompted")
    seen = explore(spec, _cat(), folder="unused")
    assert "type it, x,y or x1,y1,x2,y2" in seen.problem.value and seen.overlay.value == b""
    seen.prompt.value = "60,40"
    assert seen.caption.value.startswith("#0 mask") and seen.problem.value == ""
    x = seen.explorer.photos[seen.controls["photo"].value].x
    expected = explain.GradCAM(SamPrompted(sam, points=[(60.0, 40.0)]))(x, PromptMaskTarget()).cams[0]
    assert seen.shown.view.prompt == (60.0, 40.0)
    torch.testing.assert_close(seen.shown.cam, expected, atol=1e-5, rtol=0)
    point = seen.overlay.value
    seen.prompt.value = "20, 10, 90, 70"
    assert seen.shown.view.prompt == (20.0, 10.0, 90.0, 70.0) and seen.overlay.value != point
    shown = seen.overlay.value
    seen.prompt.value = "1,2,3"
    assert "prompt '1,2,3': give x,y (a point) or x1,y1,x2,y2 (a box)" in seen.problem.value
    assert seen.overlay.value == shown


REFUSING = {  # the methods a dense or prompted target does not fit, and what their refusal says
    "finercam": "contrasts a classifier's classes",
    "sess": "for a classifier's class",
    "dff": "picks the concept of a classifier's class",
    "cam": "weighs channels by a class's row of the classifier",
}
ROLLOUTS = ("attention_rollout", "gradient_rollout", "chefer", "legrad")  # attention models only


def _map_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, stride=2, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3, padding=1),
        torch.nn.ReLU(), torch.nn.Conv2d(8, 1, 3, padding=1),
    ).eval()  # fmt: skip


@pytest.mark.parametrize("method", [name for name in explain.METHODS if name not in ROLLOUTS])
def test_every_method_explains_a_region_and_a_prompt_or_refuses_in_one_line(method: str) -> None:
    """A region of a map model's output (N = 2) and a SAM's prompted mask: each method gives a finite map per
    image at the input's size, or refuses with the reason; the model keeps no hook, flag or gradient."""
    from test_sam import _sam
    from test_side_effects import assert_unchanged, snapshot

    cases = (
        (_map_model(), torch.rand(2, 3, 32, 40), RegionTarget(box=(4, 4, 20, 16)), "2"),
        (SamPrompted(_sam(), points=[(30.0, 20.0)]), torch.rand(1, 3, 40, 60), PromptMaskTarget(), None),
    )
    for model, x, target, layer in cases:
        layer = layer if explain.METHODS[method].reads_layer else None  # a method that reads none refuses one
        before = snapshot(model)
        if method in REFUSING:
            with pytest.raises(explain.ExplainError, match=REFUSING[method]):
                explain.METHODS[method](model, layer)(x, target)
        else:
            cams = explain.METHODS[method](model, layer)(x, target).cams
            assert cams.shape[0] == len(x) and cams.shape[-2:] == x.shape[-2:] and torch.isfinite(cams).all()
        assert_unchanged(model, before)


def test_the_apps_endpoint_takes_a_prompt_as_its_target(tmp_path) -> None:
    """``/explain`` of a SAM: the target field is the prompt, a point or a box; the overlay is the explorer's
    picture of that view; a malformed prompt is named; a SAM without one asks for it."""
    pytest.importorskip("gradio")
    from test_sam import _sam

    from explain.explorer.web import App

    sam = _sam()
    app = App(explain.ModelSpec(sam, "sam", ["mask"], UNIT_PREPROCESSING, "prompted"), explain.load_model)
    path = tmp_path / "cat.png"
    _cat().save(path)
    prompts = (("60,40", {"points": [(60.0, 40.0)]}), ("20,10,90,70", {"box": (20.0, 10.0, 90.0, 70.0)}))
    for text, keyword in prompts:
        picture, top, layer = app.explain(str(path), "", "gradcam", text)
        prompt = tuple(float(v) for v in text.split(","))
        shown = app.explorer.show("cat.png", View(prompt=prompt))  # what the endpoint drew, kept
        expected = explain.GradCAM(SamPrompted(sam, **keyword))(shown.photo.x, PromptMaskTarget())
        torch.testing.assert_close(shown.cam, expected.cams[0], atol=1e-5, rtol=0)
        assert layer == "model.vision_encoder.neck" and list(top) == [shown.entry.label]
        assert picture.size == (160, 120) and np.array_equal(np.asarray(picture), np.asarray(shown.picture()))
    with pytest.raises(explain.ExplainError, match="give x,y"):
        app.explain(str(path), "", "gradcam", "1,2,3")
    with pytest.raises(explain.ExplainError, match="draws the mask of a prompt"):
        app.explain(str(path), "", "gradcam", "")
