"""The explorer of a vision-language model: click a word, see its map. The words of a photo's answer are computed
once per question and kept (another word, alpha or colormap runs no forward); each drawing is the map of the API's
call on the processor's output; the page's handlers, its build, and the app served end to end."""

from __future__ import annotations

import io
import json
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest
import torch
from conftest import CAT
from PIL import Image
from test_vision_language import IMAGE, llava_folder  # noqa: F401  (the fixture, shared)

import explain
from explain.io.images import load_image
from explain.io.render import overlay

transformers = pytest.importorskip("transformers")
pytest.importorskip("gradio")


def _spec(folder):
    from explain.models.text_image import load_text_image_model

    return load_text_image_model(str(folder))


def _forwards(model: torch.nn.Module) -> list[int]:
    calls: list[int] = []
    model.register_forward_pre_hook(lambda m, args: calls.append(1))
    return calls


def test_a_photos_words_are_explained_once_and_each_click_draws_its_map(llava_folder) -> None:  # noqa: F811
    from explain.explorer import Explorer

    spec = _spec(llava_folder)
    explorer = Explorer(spec)  # one session type for every kind of output
    name = explorer.add(CAT).name
    assert explorer.add(load_image(CAT), "again.png").name == name  # the same photo twice is one
    request = explorer.reading("what is on the table?", "a cat", "", "gradcam")
    calls = _forwards(spec.model)
    words, record = explorer.words(name, request)
    assert [word.text for word in words] == ["a", "cat"] and record["answer"] == "a cat" and calls
    before = len(calls)
    pictures = [explorer.word_picture(name, request, k) for k in (1, 0)]
    styled = explorer.reading("what is on the table?", "a cat", "", "gradcam", alpha=0.8, colormap="viridis")
    explorer.word_picture(name, styled, 1)
    assert len(calls) == before  # drawing another word, or in another style, runs no model
    processor = spec.processor
    photo = load_image(CAT)
    given = processor(images=photo, text="USER: <image>\nwhat is on the table? ASSISTANT:", return_tensors="pt",
                      do_center_crop=False, size={"height": IMAGE, "width": IMAGE})  # fmt: skip
    found = explain.explain_answer(spec.model, dict(given), answer=processor.tokenizer("a cat").input_ids)
    for picture, k in zip(pictures, (1, 0)):
        expected = np.asarray(overlay(photo, found.maps[k]), dtype=np.int16)
        assert np.abs(np.asarray(picture, dtype=np.int16) - expected).max() <= 1
    with pytest.raises(explain.ExplainError, match="answers prompts: type a question"):
        explorer.reading("  ", "", "a cat", "gradcam")
    with pytest.raises(explain.ExplainError, match="no word 2: the photo has 2"):
        explorer.word_picture(name, request, 2)


def test_the_pages_handlers_list_the_words_and_show_a_clicked_one(llava_folder) -> None:  # noqa: F811
    from explain.explorer.web import App, build

    app = App(_spec(llava_folder), load=lambda name: _spec(name))  # one app: its page follows the task
    photo = next(iter(app.explorer.photos))
    fields = (photo, "what is on the table?", "a cat", "", "gradcam", 0.5, "jet")
    words, first, caption = app.explain_words(*fields)
    assert [value for _, value in words.choices] == [0, 1] and "a cat" in caption
    calls = _forwards(app.explorer.spec.model)
    second = app.show_word(*fields, 1)
    assert not calls and second.size == first.size
    assert np.asarray(second).tobytes() != np.asarray(first).tobytes()  # another word, another map
    page = build(app)
    assert {"question", "words", "overlay"} <= {getattr(block, "elem_id", None) for block in page.blocks.values()}


def test_the_app_takes_a_vision_language_models_folder(llava_folder, tmp_path) -> None:  # noqa: F811
    from gradio_client import Client

    from explain.explorer.session import bundled_photos
    from explain.models.text_image import is_text_image_model

    assert is_text_image_model(str(llava_folder))
    (tmp_path / "vit").mkdir()
    (tmp_path / "vit" / "config.json").write_text(json.dumps({"model_type": "vit", "image_size": 32}))
    assert not is_text_image_model(str(tmp_path / "vit"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "explain", "app", "--model", str(llava_folder), "--port", str(port), "--quiet"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=tmp_path,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}/"
    try:
        for _ in range(240):
            assert server.poll() is None, server.stderr.read().decode()
            try:
                urllib.request.urlopen(url, timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        client = Client(url, verbose=False)
        words, picture, caption = client.predict(
            "chelsea.jpg", "what is on the table?", "a cat", "", "gradcam", 0.5, "jet", api_name="/explain_words"
        )
        assert "a cat" in caption and [choice[1] for choice in words["choices"]] == [0, 1]
        assert load_image(picture).size == load_image(bundled_photos()[0]).size  # drawn on the whole photo
    finally:
        server.terminate()
        server.wait(30)


def test_the_notebook_follows_the_task_to_the_words_widgets(llava_folder) -> None:  # noqa: F811
    """``explore`` of a vision-language model gives its words' widgets: the words of the question to pick, each
    picked word drawn as the session draws it, without running the model again."""
    pytest.importorskip("ipywidgets")
    from explain.notebook import WordsNotebook, explore

    spec = _spec(llava_folder)
    seen = explore(spec, CAT)
    assert isinstance(seen, WordsNotebook)
    seen.controls["question"].value, seen.controls["answer"].value = "what is on the table?", "a cat"
    seen.explain()
    assert [value for _, value in seen.controls["words"].options] == [0, 1] and seen.caption.value.startswith("a cat")
    calls = _forwards(spec.model)
    seen.controls["words"].value = 1
    request = seen.explorer.reading("what is on the table?", "a cat", "", "gradcam")
    expected = seen.explorer.word_picture(next(iter(seen.explorer.photos)), request, 1)
    shown = np.asarray(Image.open(io.BytesIO(seen.overlay.value)))
    assert not calls and np.array_equal(shown, np.asarray(expected))
    seen.controls["question"].value = " "
    seen.explain()
    assert "answers prompts: type a question" in seen.problem.value
