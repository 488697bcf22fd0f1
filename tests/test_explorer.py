"""The interactive explorer: its kept maps, the web app (its API through gradio_client, its page in a real
browser), the notebook explorer, a result's display in Jupyter, and the tutorial notebooks run top to bottom."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import matplotlib
import numpy as np
import pytest
import torch
from conftest import CAT, COFFEE, seeded
from PIL import Image

import explain
from explain.explorer import Explorer, View, bundled_photos
from explain.explorer.web import App

ROOT = Path(__file__).resolve().parents[1]
TUTORIALS = sorted((ROOT / "docs" / "tutorials").glob("*.ipynb"))
BROWSER = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
if (BROWSER is None or DRIVER is None) and os.environ.get("EXPLAIN_REQUIRE_BROWSER"):
    raise RuntimeError("the explorer's page test needs chromium and its driver (apt-get install chromium-driver)")


@pytest.fixture(scope="module")
def lite0() -> explain.ModelSpec:
    return explain.load_model("efficientnet_lite0")


def counted(model: torch.nn.Module) -> list[int]:
    """A list that grows by one at every forward pass of the model (its hook removed with the test's model)."""
    calls: list[int] = []
    model.register_forward_hook(lambda *_: calls.append(1))
    return calls


def test_a_class_click_explains_once_and_alpha_runs_no_forward(lite0) -> None:
    spec = explain.load_model("efficientnet_lite0")
    calls = counted(spec.model)
    explorer = Explorer(spec)
    photo = explorer.add(CAT)
    top = explorer.entries(photo.name)
    assert top[0].class_name == "Egyptian cat"  # the bundled model's answer on the photo
    assert [e.probability for e in top] == sorted((e.probability for e in top), reverse=True)
    shown = explorer.show(photo.name, View())
    assert shown.view.target == 285 and shown.layer == "bn2"
    first = len(calls)
    pictures = [np.asarray(shown.picture(alpha, colormap)) for alpha in (0.2, 0.5, 0.9) for colormap in ("jet", "gray")]
    assert torch.equal(explorer.show(photo.name, View(target=285)).cam, shown.cam)  # the top class by number
    assert len(calls) == first  # drawing again and the same view run no model
    assert len({p.tobytes() for p in pictures}) == len(pictures)
    assert pictures[0].shape[:2] == Image.open(CAT).size[::-1]
    base, heat = shown.layers("viridis")
    assert np.array_equal(base, np.asarray(Image.open(CAT).convert("RGB")))
    height, width = base.shape[:2]
    resized = torch.nn.functional.interpolate(shown.cam[None, None], (height, width), mode="bilinear")[0, 0]
    colours = matplotlib.colormaps["viridis"](resized.numpy())[..., :3]
    assert np.abs(heat / 255 - colours).max() < 2 / 255  # the heat layer: the map in the colormap's colours
    tabby = explorer.show(photo.name, View(target=281))
    assert len(calls) == first + 1  # a new class: one forward (and its backward)
    reference = explain.GradCAM(lite0.model, labels=lite0.labels)(lite0.preprocess(CAT), 281)
    torch.testing.assert_close(tabby.cam, reference.cams[0].cpu(), atol=1e-5, rtol=0)
    assert tabby.entry.class_name == "tabby"
    assert tabby.entry.probability == pytest.approx(float(reference.probabilities[0]), abs=1e-6)


def test_views_of_layers_fusion_and_another_method_match_direct_calls(lite0) -> None:
    explorer = Explorer(lite0)
    photo = explorer.add(COFFEE)
    menu = explorer.layer_menu(photo.name)
    assert [name for _, name in menu if "[automatic]" in _] == ["bn2"]
    x = lite0.preprocess(COFFEE)
    shown = explorer.show(photo.name, View("layercam", ("blocks.5", "bn2"), 967, "max"))
    direct = explain.cam(lite0.model, x, "layercam", ["blocks.5", "bn2"], 967, fuse="max")
    torch.testing.assert_close(shown.cam, direct[0].cpu(), atol=1e-5, rtol=0)
    assert shown.layer == "blocks.5+bn2"
    with pytest.raises(explain.ExplainError, match="unknown method"):
        explorer.show(photo.name, View("gradkam"))


def test_the_same_photo_twice_is_one_photo_and_a_name_taken_gets_a_suffix(lite0, tmp_path) -> None:
    explorer = Explorer(lite0)
    copy = tmp_path / "chelsea.png"
    shutil.copy(CAT, copy)
    assert explorer.add(CAT).name == explorer.add(copy).name == "chelsea.png"
    other = tmp_path / "other" / "chelsea.png"
    other.parent.mkdir()
    Image.open(COFFEE).save(other)
    assert explorer.add(other).name == "chelsea (2).png"
    broken = tmp_path / "notes.txt"
    broken.write_text("not an image")
    with pytest.raises(explain.ImageLoadError, match=r"notes\.txt: not an image"):
        explorer.add(broken)


def test_a_saved_view_is_the_overlay_the_map_and_a_manifest_record(lite0, tmp_path) -> None:
    explorer = Explorer(lite0)
    photo = explorer.add(CAT)
    shown = explorer.show(photo.name, View(target=282))
    overlay, raw, record = explorer.save(shown, tmp_path / "out", 0.3, "viridis")
    assert np.array_equal(np.asarray(Image.open(overlay)), np.asarray(shown.picture(0.3, "viridis")))
    assert np.array_equal(np.load(raw), shown.cam.numpy())
    written = json.loads(record.read_text())
    assert written["targets"][0]["class_name"] == "tiger cat" and written["layer"] == "bn2"
    assert written["view"]["alpha"] == 0.3 and written["raw"] == raw.name
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(p.name for p in (overlay, raw, record))


def test_faithfulness_of_a_view_is_the_metrics_of_its_map(lite0) -> None:
    explorer = Explorer(lite0)
    photo = explorer.add(CAT)
    shown = explorer.show(photo.name, View())
    found = explorer.faithfulness(shown)
    x = lite0.preprocess(CAT)
    result = explain.GradCAM(lite0.model)(x)
    deleted = explain.metrics.deletion(lite0.model, x, result.cams, result.target)
    assert found.deletion_auc == pytest.approx(float(deleted.auc[0]), abs=1e-4)
    assert found.deletion == pytest.approx(deleted.curve[0].tolist(), abs=1e-4)
    assert found.insertion_auc > found.deletion_auc  # a faithful map: the class returns fast, leaves fast
    checked = explain.metrics.sanity_check(lite0.model, x, "gradcam", depths=[1])
    assert found.sanity == ("fails" if float(checked.spearman[0, 0]) >= 0.5 else "passes")
    eigen = explorer.faithfulness(explorer.show(photo.name, View("eigencam")))
    assert eigen.sanity == "fails"  # Eigen-CAM never reads the classifier: its map stays when it is random


def test_a_detector_lists_its_detections_and_explains_each(tmp_path) -> None:
    from conftest import random_detector

    model = random_detector((160, 160))
    spec = explain.ModelSpec(
        model,
        "detector",
        [f"c{i}" for i in range(91)],
        explain.models.Preprocessing(None, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)),
        task="detection",
    )
    explorer = Explorer(spec)
    image = Image.open(CAT).convert("RGB").resize((160, 160))
    photo = explorer.add(image, "cat.png")
    entries = explorer.entries(photo.name)
    assert entries and all(e.box is not None for e in entries)
    result = explain.GradCAM(model)(photo.x, explain.targets.DetectionTarget(score_threshold=0.5))
    picked = [j for _, j in result.shown()]
    for place, entry in enumerate(entries[:2]):
        shown = explorer.show(photo.name, View(target=place))
        torch.testing.assert_close(shown.cam, result.cams[0, picked[place]].cpu(), atol=1e-5, rtol=0)
        assert entry.box == pytest.approx(tuple(result.target.boxes[0, picked[place]].tolist()), abs=1e-3)
    with pytest.raises(explain.ExplainError, match="no #99"):
        explorer.show(photo.name, View(target=99))


def test_a_result_shows_itself_in_jupyter_with_one_image_per_map() -> None:
    model = seeded("resnet18")
    x = torch.randn(2, 3, 64, 64)
    result = explain.GradCAM(model, labels=[f"c{i}" for i in range(1000)])(x, explain.targets.TopK(3))
    page = result._repr_html_()
    assert page.count("<img") == 6 == len(result.captions())
    assert result.captions()[0].startswith(f"0: c{int(result.class_indices[0, 0])} ")
    assert "gradcam · layer4" in result.captions()[0]
    figure = result.show(columns=3)
    assert len(figure.axes) == 6
    guided = explain.methods.GuidedBackprop(model)(x)
    assert guided._repr_html_().count("<img") == 2
    assert explain.GradCAM(model)(torch.randn(1, 3, 64, 64))._repr_html_().count("<img") == 1


def test_notebook_explorer_draws_again_without_the_model(lite0) -> None:
    from explain.notebook import explore

    spec = explain.load_model("efficientnet_lite0")
    calls = counted(spec.model)
    seen = explore(spec, [CAT, COFFEE], folder="unused")
    assert seen.caption.value.startswith("Egyptian cat")
    first, before = len(calls), seen.overlay.value
    seen.controls["alpha"].value = 0.9
    seen.controls["colormap"].value = "gray"
    assert len(calls) == first and seen.overlay.value != before
    seen.controls["entries"].value = 282
    assert seen.caption.value.startswith("tiger cat") and len(calls) == first + 1
    seen.controls["typed"].value = "tabby"
    assert seen.caption.value.startswith("tabby")
    seen.controls["photo"].value = "coffee.png"
    assert seen.caption.value.startswith("espresso")
    model = seeded("resnet18", num_classes=7).train()
    bare = explore(model, CAT)
    assert bare.caption.value.startswith("class ") and model.training


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def app_url(tmp_path_factory):
    """``explain app`` on a free local port, in a subprocess."""
    port = free_port()
    log = tmp_path_factory.mktemp("app") / "log"
    with open(log, "w") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "explain", "app", "--port", str(port), "--quiet"],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=tmp_path_factory.mktemp("cwd"),
        )
    url = f"http://127.0.0.1:{port}/"
    try:
        for _ in range(240):
            if server.poll() is not None:
                raise RuntimeError(f"explain app stopped: {log.read_text()}")
            try:
                urllib.request.urlopen(url, timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        else:
            raise RuntimeError(f"explain app did not start: {log.read_text()}")
        yield url
    finally:
        server.terminate()
        server.wait(30)


def test_app_api_explains_a_bundled_photo(app_url) -> None:
    from gradio_client import Client, handle_file

    client = Client(app_url, verbose=False)
    overlay, classes, layer = client.predict(handle_file(str(CAT)), "", "gradcam", "", api_name="/explain")
    assert Image.open(overlay).size == Image.open(CAT).size
    assert classes["label"] == "Egyptian cat" and layer == "bn2"
    _, classes, _ = client.predict(
        handle_file(str(CAT)), "efficientnet_lite0", "layercam", "tabby", api_name="/explain"
    )
    assert classes["label"] == "Egyptian cat"  # the top classes, whatever is explained
    with pytest.raises(Exception, match="unknown method"):
        client.predict(handle_file(str(CAT)), "", "gradkam", "", api_name="/explain")


@pytest.mark.skipif(BROWSER is None or DRIVER is None, reason="chromium and chromedriver not installed")
def test_app_page_in_a_browser(app_url, tmp_path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    browser = chrome()
    wait = WebDriverWait(browser, 120)

    def caption() -> str:
        return browser.find_element(By.ID, "caption").text

    def overlay() -> str | None:
        found = browser.find_elements(By.CSS_SELECTOR, "#overlay img.heat")
        return found[0].get_attribute("src") if found else None

    try:
        browser.get(app_url)
        wait.until(lambda _: "Egyptian cat" in caption() and overlay(), "the first photo explained")
        shown = overlay()
        browser.find_elements(By.CSS_SELECTOR, "input[type=file]")[0].send_keys(str(COFFEE))
        wait.until(lambda _: "espresso" in caption() and overlay() != shown, "the upload explained")
        shown = overlay()
        second = browser.find_elements(By.CSS_SELECTOR, "#entries label")[1]
        name = second.text.rsplit(" ", 1)[0]
        second.click()
        wait.until(lambda _: caption().startswith(name) and overlay() != shown, "the clicked class explained")
        shown = overlay()
        method = browser.find_element(By.CSS_SELECTOR, "#method input")
        method.click()
        method.send_keys(Keys.CONTROL, "a")
        method.send_keys("gradcampp")  # not hirescam: on this head its maps are Grad-CAM's
        method.send_keys(Keys.ENTER)
        wait.until(lambda _: "gradcampp" in caption() and overlay() != shown, "the other method shown")
        shown = overlay()
        number = browser.find_element(By.CSS_SELECTOR, "#alpha input[type=number]")
        number.send_keys(Keys.CONTROL, "a")
        number.send_keys("0.8", Keys.ENTER)
        heat = "#overlay img.heat"
        wait.until(lambda _: browser.find_element(By.CSS_SELECTOR, heat).value_of_css_property("opacity") == "0.8")
        assert overlay() == shown  # alpha is the heat layer's opacity in the page: nothing drawn again
        notes = tmp_path / "notes.txt"
        notes.write_text("not an image")
        browser.find_elements(By.CSS_SELECTOR, "input[type=file]")[0].send_keys(str(notes))
        wait.until(lambda _: "notes.txt: not an image" in browser.find_element(By.TAG_NAME, "body").text, "the error")
        errors = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
        assert not errors, errors
    finally:
        browser.quit()


@pytest.mark.skipif(BROWSER is None or DRIVER is None, reason="chromium and chromedriver not installed")
def test_app_page_finds_concepts_and_draws_the_one_clicked(app_url) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser = chrome()
    wait = WebDriverWait(browser, 120)

    def drawn() -> str | None:
        found = browser.find_elements(By.CSS_SELECTOR, "#concept_map img")
        return found[0].get_attribute("src") if found else None

    try:
        browser.get(app_url)
        wait.until(lambda _: "Egyptian cat" in browser.find_element(By.ID, "caption").text, "the first photo explained")
        opener = browser.find_element(By.CSS_SELECTOR, "#concepts_panel button")
        browser.execute_script("arguments[0].scrollIntoView(); arguments[0].click();", opener)
        wait.until(lambda _: browser.find_element(By.ID, "find_concepts").is_displayed(), "the panel opened")
        browser.find_element(By.ID, "find_concepts").click()
        said = lambda _: " ".join(browser.find_element(By.ID, "concepts_found").text.split())  # noqa: E731
        found = re.compile(r"6 concepts at bn2 , from \d+ crops of \d+ photos")  # an earlier test may have uploaded
        wait.until(lambda _: found.search(said(_)), "the concepts found")
        labels = browser.find_elements(By.CSS_SELECTOR, "#concepts label")
        assert len(labels) == 6 and all(" of the photo" in label.text for label in labels)
        wait.until(lambda _: drawn(), "the first concept drawn")
        first = drawn()
        wait.until(lambda _: len(browser.find_elements(By.CSS_SELECTOR, "#concept_crops img")) == 6, "its crops")
        labels[1].click()
        wait.until(lambda _: drawn() not in (None, first), "the clicked concept drawn")
        errors = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
        assert not errors, errors
    finally:
        browser.quit()


def chrome():
    """A headless chromium driven by selenium, its console logged."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = BROWSER
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1400,1000"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(DRIVER), options=options)


def test_app_warns_when_open_to_the_network(monkeypatch, capsys) -> None:
    from explain.explorer import web

    launched = {}
    monkeypatch.setattr(
        web, "build", lambda app: type("Page", (), {"launch": lambda self, **kw: launched.update(kw)})()
    )
    web.serve("efficientnet_lite0", host="0.0.0.0", port=7999)
    assert launched["server_name"] == "0.0.0.0" and launched["server_port"] == 7999
    assert "anyone who can reach this machine" in capsys.readouterr().err
    web.serve("efficientnet_lite0")
    assert launched["server_name"] == "127.0.0.1" and "warning" not in capsys.readouterr().err


def test_the_app_runs_every_handler_on_one_model_thread_in_the_caller_s_context() -> None:
    """Handlers called from the server's many worker threads all run on one thread (PyTorch's OpenMP teams of
    several threads slow a small model down twice on two cores), see the caller's context variables (Gradio's
    page warnings), let errors through, and may call each other without waiting on themselves."""
    import contextvars
    from concurrent.futures import ThreadPoolExecutor

    from explain.explorer.web import on_model_thread, user_errors

    request = contextvars.ContextVar("request", default=None)

    @on_model_thread
    def where() -> tuple[str, str | None]:
        return threading.current_thread().name, request.get()

    def from_a_worker(i: int) -> tuple[str, str | None]:
        request.set(f"request {i}")
        return where()

    with ThreadPoolExecutor(4) as workers:
        seen = list(workers.map(from_a_worker, range(8)))
    assert {name for name, _ in seen} == {seen[0][0]} and seen[0][0].startswith("explain-model")
    assert [context for _, context in seen] == [f"request {i}" for i in range(8)]
    assert on_model_thread(lambda: where()[0])() == seen[0][0]  # nested: runs in place, no deadlock

    def refused() -> None:
        raise explain.ExplainError("photo.png: not an image")

    with pytest.raises(Exception, match=r"photo\.png: not an image") as raised:
        user_errors(refused)()
    assert type(raised.value).__name__ == "Error"  # Gradio's, shown in the page as the one line


def test_the_method_menu_marks_the_methods_of_many_passes_with_their_cost() -> None:
    from explain.catalog import METHOD_CATALOG
    from explain.explorer import method_choices

    labels = dict((name, label) for label, name in method_choices())
    assert list(labels) == [entry.name for entry in METHOD_CATALOG]
    assert labels["scorecam"].endswith("[slow: one forward per channel]")
    assert labels["occlusion"].endswith("[slow: one forward per window placement]")
    for cheap in ("gradcam", "attention_rollout", "random", "sobel", "deeplift"):  # one or two passes
        assert "slow" not in labels[cheap], labels[cheap]
    assert not [e.name for e in METHOD_CATALOG if e.cost and e.fast]  # a slow method is not in --method all


def test_app_without_gradio_names_its_install(monkeypatch, capsys) -> None:
    from explain.cli import main

    monkeypatch.setitem(sys.modules, "gradio", None)
    assert main(["app"]) == 2
    assert 'pip install "explain[app]"' in capsys.readouterr().err


def test_app_handlers_keep_the_good_uploads_and_name_the_bad(lite0, tmp_path) -> None:
    app = App(lite0, explain.load_model)
    bad = tmp_path / "notes.txt"
    bad.write_text("x")
    menu, problems = app.add([str(COFFEE), str(bad)])
    assert menu.value == "coffee.png" and problems == "notes.txt: not an image, or a format Pillow cannot read"
    assert list(app.explorer.photos) == [p.name for p in bundled_photos()] + ["coffee.png"]


@pytest.mark.parametrize("notebook", TUTORIALS, ids=lambda p: p.name)
def test_tutorial_notebook_runs_top_to_bottom(notebook, tmp_path) -> None:
    import nbformat
    from nbclient import NotebookClient

    document = nbformat.read(notebook, as_version=4)
    NotebookClient(
        document, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    outputs = [output for cell in document.cells if cell.cell_type == "code" for output in cell.outputs]
    assert not [output for output in outputs if output.output_type == "error"]
    assert any("text/html" in output.get("data", {}) for output in outputs)  # a result shown as its overlays


def test_there_are_two_tutorials() -> None:
    assert [p.name for p in TUTORIALS] == ["classifier.ipynb", "vit_and_detector.ipynb"]


def test_a_scan_is_browsed_slice_by_slice_without_the_model(tmp_path) -> None:
    from test_volumes import peak_model

    from explain.io.volumes import Volume, montage
    from explain.models import ModelSpec, VolumePreprocessing

    data = np.zeros((10, 16, 12), np.float32)
    data[6, 5, 7] = 5.0  # the peak model's Grad-CAM is one-hot at the brightest voxel
    np.save(tmp_path / "scan.npy", data)
    spec = ModelSpec(peak_model(), "peak", ["peak"], VolumePreprocessing(mean=0.0, std=1.0))
    calls = counted(spec.model)
    explorer = Explorer(spec)
    photo = explorer.add(tmp_path / "scan.npy")
    assert (str(photo.kind), photo.depth, tuple(photo.x.shape)) == ("volume", 10, (1, 1, 10, 16, 12))
    shown = explorer.show(photo.name, View(layers=("1",)))
    assert shown.cam.shape == data.shape and shown.peak == 6
    first = len(calls)
    at_peak = np.asarray(shown.picture(0.4, "jet"))
    sheet = np.asarray(montage(Volume(data, np.eye(4)), shown.cam, 0.4, "jet"))
    assert np.array_equal(at_peak, sheet[:, :12])  # the montage's axial panel is the slice through the peak
    assert not np.array_equal(np.asarray(shown.picture(0.4, "jet", index=2)), at_peak)
    with pytest.raises(explain.ExplainError, match=r"scan\.npy has 10 slices; no 10"):
        shown.picture(index=10)
    _, raw, record = explorer.save(shown, tmp_path / "out", 0.4, "jet", index=2)
    assert json.loads(record.read_text())["view"]["index"] == 2 and np.load(raw).shape == data.shape
    assert len(calls) == first  # slices, alpha and saving run no model
    app = App(spec, explain.load_model)
    assert list(app.explorer.photos) == []  # no bundled photos for a model of scans
    app.explorer.add(tmp_path / "scan.npy")
    page, caption, slider = app.draw("scan.npy", "gradcam", ["1"], None, "mean", False, False, [], 0.4, "jet", None)
    assert page.count("data:image/jpeg;base64,") == 2 and "opacity:0.4" in page  # the slice and its map
    assert caption.endswith("slice 6 of 10 (the peak)") and slider.value == 6 and slider.maximum == 9
    drawn = len(calls)
    _, caption, _ = app.draw("scan.npy", "gradcam", ["1"], None, "mean", False, False, [], 0.4, "jet", 3)
    assert caption.endswith("slice 3 of 10") and len(calls) == drawn


def test_a_clip_is_scrubbed_frame_by_frame(tmp_path) -> None:
    import torchvision
    from test_volumes import make_video

    from explain.models import ClipPreprocessing, ModelSpec

    frames = np.zeros((20, 48, 64, 3), np.uint8)
    for t in range(20):
        frames[t, 10:30, 2 * t : 2 * t + 16] = (220, 180, 40)
    make_video(tmp_path / "clip.mkv", frames, 10)
    torch.manual_seed(0)
    model = torchvision.models.video.r3d_18(num_classes=3).eval()
    preprocessing = ClipPreprocessing(8, (48, 64), (48, 64), (0.45, 0.45, 0.45), (0.225, 0.225, 0.225))
    explorer = Explorer(ModelSpec(model, "r3d", ["a", "b", "c"], preprocessing))
    photo = explorer.add(tmp_path / "clip.mkv")
    sampled = frames[np.linspace(0, 19, 8).round().astype(int)]
    assert photo.depth == 8 and np.array_equal(photo.image.numpy(), sampled)  # lossless: the frames as written
    shown = explorer.show(photo.name, View())
    direct = explain.GradCAM(model)(preprocessing(sampled)[None])
    torch.testing.assert_close(shown.cam, direct.cams[0], atol=1e-5, rtol=0)
    assert shown.peak == int(direct.cams[0].flatten(1).amax(dim=1).argmax())
    for t in (0, 5):
        expected = np.asarray(explain.overlay(sampled[t], direct.cams[0, t], 0.5, "jet"))
        assert np.array_equal(np.asarray(shown.picture(index=t)), expected)
    with pytest.raises(explain.ExplainError, match=r"clip\.mkv has 8 frames; no 8"):
        shown.picture(index=8)


def test_a_signal_is_drawn_over_its_map(tmp_path) -> None:
    from test_volumes import signal_net

    from explain.models import ModelSpec, SignalPreprocessing

    signal = np.stack([np.sin(np.arange(120) / 6), np.cos(np.arange(120) / 9)]).astype(np.float32)
    np.save(tmp_path / "ecg.npy", signal)
    spec = ModelSpec(signal_net(), "net", ["a", "b", "c"], SignalPreprocessing())
    explorer = Explorer(spec)
    photo = explorer.add(tmp_path / "ecg.npy")
    shown = explorer.show(photo.name, View())
    x = spec.preprocessing.standardized(torch.from_numpy(signal), axis=-1)[None]
    torch.testing.assert_close(shown.cam, explain.GradCAM(spec.model)(x).cams[0], atol=1e-6, rtol=0)
    base, heat = shown.layers()
    assert heat is None and shown.peak is None  # one picture: the signal over its band, no slider
    assert base.shape[1] == 1000 and base.shape[0] == 2 * 120 + 40  # two panels of 1.2 in, at 100 dpi
    with pytest.raises(explain.ExplainError, match="net reads signal files; give a file's path"):
        explorer.add(signal)


def test_the_notebook_explorer_has_a_slice_slider_for_scans(tmp_path) -> None:
    from test_volumes import peak_model, volume_net

    from explain.models import ModelSpec, VolumePreprocessing
    from explain.notebook import explore

    data = torch.rand(10, 16, 12).numpy()
    np.save(tmp_path / "scan.npy", data)
    spec = ModelSpec(volume_net(), "net", list("abcd"), VolumePreprocessing())
    calls = counted(spec.model)
    seen = explore(spec, tmp_path / "scan.npy", folder=tmp_path / "views")
    x = spec.preprocessing.standardized(torch.from_numpy(data))[None, None]
    peak = int(explain.GradCAM(spec.model)(x).cams[0].flatten(1).amax(dim=1).argmax())
    assert seen.controls["index"].value == peak and seen.controls["index"].max == 9  # the peak's slice first
    first, before = len(calls), seen.overlay.value
    seen.controls["index"].value = (peak + 5) % 10
    assert seen.overlay.value != before and len(calls) == first
    assert json.loads(seen.save()[2].read_text())["view"]["index"] == (peak + 5) % 10
    bare = explore(ModelSpec(peak_model(), "peak", ["peak"], VolumePreprocessing()), tmp_path / "scan.npy")
    assert "pass layer=" in bare.problem.value and bare.controls["layers"].options  # pick one of the listed
