"""What ``explain concepts`` writes: the atlas as a self-contained page (``atlas.html``), a sheet of each concept's
best crops (``atlas.png``), each image's concept maps (``maps/NAME.png``) and a manifest (``manifest.json``); each
file written whole."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from ..concepts.craft import cut
from ..io.atomic import write_atomically
from ..io.render import data_uri, input_picture, overlay
from ..models.spec import ModelSpec
from .run import Atlas

PAGE, SHEET, MANIFEST, MAPS = "atlas.html", "atlas.png", "manifest.json", "maps"
BEST = 6  # crops per concept shown
THUMB = 96  # pixels of a crop or a map in the sheet and the page
PAGE_IMAGES = 24  # images whose maps the page shows inline (all are in maps/)


def shown(spec: ModelSpec, x: Any) -> np.ndarray:
    """An input (C, H, W) as the picture it was: the model's normalization undone where it is known, else each
    channel min-max scaled."""
    mean, std = getattr(spec.preprocessing, "mean", None), getattr(spec.preprocessing, "std", None)
    if mean is None or std is None or x.shape[0] != len(mean):
        return input_picture(x)
    values = x.detach().cpu().float() * x.new_tensor(std).cpu()[:, None, None] + x.new_tensor(mean).cpu()[:, None, None]
    return (values.clamp(0, 1) * 255 + 0.5).byte().permute(1, 2, 0).numpy()


def write_atlas(atlas: Atlas, spec: ModelSpec, out: Path) -> dict[str, Any]:
    """Write the atlas's files into ``out``; returns the manifest."""
    pictures = [shown(spec, x) for x in atlas.images]
    order = atlas.importance.ranking.tolist()
    crops = _best_crops(atlas, spec, order)
    strips = []
    for name, picture, maps in zip(atlas.names, pictures, atlas.maps):
        strip = _row([overlay(picture, maps[k].cpu()).resize((THUMB, THUMB)) for k in order])
        write_atomically(out / MAPS / f"{Path(name).stem}.png", lambda temp, s=strip: s.save(temp, format="PNG"))
        strips.append(strip)
    manifest = _manifest(atlas, spec, order)
    write_atomically(out / SHEET, lambda temp: _sheet(manifest, crops).save(temp, format="PNG"))
    write_atomically(out / PAGE, lambda temp: temp.write_text(_page(manifest, crops, strips), encoding="utf-8"))
    write_atomically(out / MANIFEST, lambda temp: temp.write_text(json.dumps(manifest, indent=1), encoding="utf-8"))
    return manifest


def _best_crops(atlas: Atlas, spec: ModelSpec, order: list[int]) -> list[list[Image.Image]]:
    """Each concept's best crops, as pictures, in the concepts' order of importance."""
    best = atlas.bank.best_crops(BEST)
    return [
        [Image.fromarray(shown(spec, c)).resize((THUMB, THUMB)) for c in cut(atlas.images, atlas.bank.boxes[best[k]])]
        for k in order
    ]


def _row(pictures: list[Image.Image]) -> Image.Image:
    """Pictures side by side."""
    row = Image.new("RGB", (THUMB * len(pictures), THUMB), "white")
    for i, shown_picture in enumerate(pictures):
        row.paste(shown_picture, (i * THUMB, 0))
    return row


def _manifest(atlas: Atlas, spec: ModelSpec, order: list[int]) -> dict[str, Any]:
    """What the atlas holds, concepts in order of importance."""
    importance, bank = atlas.importance, atlas.bank
    best = bank.best_crops(BEST)

    def crop(index: int) -> dict[str, Any]:
        image, top, left, side = bank.boxes[index].tolist()
        return {"image": atlas.names[image], "top": top, "left": left, "side": side}

    return {
        "model": spec.name, "layer": bank.layer, "class": atlas.target[0], "class_name": atlas.target[1],
        "images": len(atlas.names), "crops": len(bank.boxes), "signed": bank.signed,
        "reconstruction_error": round(bank.error, 6),
        "concepts": [
            {
                "concept": k, "importance": float(importance.indices[k]), "low": float(importance.low[k]),
                "high": float(importance.high[k]), "best_crops": [crop(i) for i in best[k].tolist()],
            }
            for k in order
        ],
        "maps": {name: f"{MAPS}/{Path(name).stem}.png" for name in atlas.names},
    }  # fmt: skip


def _label(concept: dict[str, Any]) -> str:
    return (
        f"concept {concept['concept']}: importance {concept['importance']:.3f} "
        f"(95%: {concept['low']:.3f} to {concept['high']:.3f})"
    )


def _sheet(manifest: dict[str, Any], crops: list[list[Image.Image]]) -> Image.Image:
    """Each concept's label over its best crops, one row per concept."""
    line = 18
    sheet = Image.new("RGB", (THUMB * BEST, (THUMB + line) * len(crops) + line), "white")
    draw = ImageDraw.Draw(sheet)
    draw.text((4, 2), f"{manifest['class_name']} at {manifest['layer']} ({manifest['model']})", fill="black")
    for row, (concept, pictures) in enumerate(zip(manifest["concepts"], crops)):
        top = line + row * (THUMB + line)
        draw.text((4, top + 2), _label(concept), fill="black")
        sheet.paste(_row(pictures), (0, top + line))
    return sheet


def _page(manifest: dict[str, Any], crops: list[list[Image.Image]], strips: list[Image.Image]) -> str:
    """The atlas as one HTML page, its pictures inline."""
    title = html.escape(f"Concepts of {manifest['class_name']} at {manifest['layer']} ({manifest['model']})")
    rows = []
    for concept, pictures in zip(manifest["concepts"], crops):
        width = max(0.0, min(1.0, concept["importance"])) * 100
        images = "".join(f'<img src="{data_uri(p)}" width="{THUMB}" alt="best crop">' for p in pictures)
        rows.append(
            f'<section class="concept"><h2>{html.escape(_label(concept))}</h2>'
            f'<div class="bar"><div style="width:{width:.1f}%"></div></div><div>{images}</div></section>'
        )
    names = list(manifest["maps"])[:PAGE_IMAGES]
    maps = "".join(
        f'<figure><img src="{data_uri(strip)}" alt="concept maps"><figcaption>{html.escape(name)}</figcaption></figure>'
        for name, strip in zip(names, strips)
    )
    more = len(manifest["maps"]) - len(names)
    note = f"<p>{more} more images' maps are in {MAPS}/.</p>" if more > 0 else ""
    summary = (
        f"{manifest['images']} images, {manifest['crops']} crops, {len(manifest['concepts'])} concepts "
        f"({'semi-NMF' if manifest['signed'] else 'NMF'}, reconstruction error {manifest['reconstruction_error']:.3f})"
    )
    style = (
        "body{font-family:sans-serif;margin:16px}.bar{background:#eee;width:300px;height:8px;margin:4px 0}"
        ".bar div{background:#c33;height:8px}figure{margin:8px 0}img{margin-right:2px}"
    )
    return (
        f'<!doctype html><html><head><meta charset="utf-8"><title>{title}</title><style>{style}</style></head>'
        f"<body><h1>{title}</h1><p>{html.escape(summary)}; concepts in order of importance, each with its best "
        f"crops.</p>{''.join(rows)}<h2>Where each concept lies, image by image (concepts in the order above)</h2>"
        f"{maps}{note}</body></html>"
    )
