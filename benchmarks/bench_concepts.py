"""Concepts against their peers, ratios in one process on the same model, images, crops and activations (the CPU).

- **CRAFT** (factorization and importance): ``explain.concepts.Craft`` against craft-xai 0.0.3's PyTorch ``Craft``
  (scikit-learn's NMF, its Sobol masks and estimator in numpy, the model split by hand into the part before the layer
  and the part after), on the bundled EfficientNet-Lite0 at ``bn2``, the bundled photos and their mirror images,
  crops of 64 pixels, 10 concepts, 32 designs. craft-xai's torch module imports TensorFlow for a sampler it does not
  use here: a stand-in module takes its place while it is imported (``pip install --no-deps craft-xai==0.0.3``).
  Target: explain at least 5x faster, timed three ways: the factorization of the same crops' activations, the
  importance of the same concepts on the same images, and both whole with the crops read.
- **CRP**: K = 16 concept maps (one channel each) at a layer of VGG-11 with batch norms (random weights, 64x64
  images), explain's one call against 16 calls of zennit-crp 0.6's ``CondAttribution`` with the same composite.
  zennit-crp pins ``zennit<=0.4.6``: the row runs where it imports, a venv of its own that sees the project's venv
  (``python -m venv crp``, a ``crp/lib/python3.11/site-packages/up.pth`` naming ``.venv/lib/python3.11/site-packages``
  and the repository's root, each on its own line, ``crp/bin/pip install --no-deps zennit==0.4.6 zennit-crp==0.6.0``,
  then ``crp/bin/python benchmarks/bench_concepts.py``: every row in one process).
  Target: at least 3x.
- **TCAV**: a concept's score and its significance over R random halves at Lite0's ``bn2``: explain's ``TCAV``
  against Captum 0.9's ``TCAV`` with its default classifier, over the same concept sets (the concept against each
  random half, and each null pair). Target: at least 5x.
- **Memory**: the factorization's peak memory over the activations it is given, streamed in batches of 1024 crops
  (never held whole), for 4k, 16k and 64k crops of 1280 channels: it should not grow with the crops.

    python benchmarks/bench_concepts.py [--rounds 3] [--out benchmarks/results_concepts_cpu.md]
"""

from __future__ import annotations

import sys
import tempfile
import types
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from timing import emit, interleaved_medians, peak_mib, rounds_and_out, stolen_share
from torch import nn

import explain
from explain.concepts import TCAV, ConceptRelevance, Craft
from explain.concepts.craft import cut
from explain.concepts.factorization import factorize

ROOT = Path(__file__).resolve().parents[1]
PHOTOS = sorted((ROOT / "assets").glob("*.[pj][np]g")) + sorted((ROOT / "explain" / "data" / "photos").glob("*.jpg"))
CONCEPTS, CROP, DESIGNS, BATCH = 10, 64, 32, 64


def lite0_images() -> tuple[nn.Module, torch.Tensor, int]:
    """The bundled model, the bundled photos and their mirror images as its input, and the class most of them
    are."""
    spec = explain.load_model("efficientnet_lite0")
    images = spec.preprocess(PHOTOS)
    images = torch.cat([images, images.flip(-1)])
    with torch.no_grad():
        top = spec.model(images).argmax(dim=1)
    return spec.model, images, int(top.mode().values)


def craft_rows(model: nn.Module, images: torch.Tensor, label: int) -> list[tuple[str, dict, float]]:
    """explain's CRAFT and craft-xai's on the same crops' activations (factorization) and the same images and
    concepts (importance), and each whole (the crops read too)."""
    import numpy as np
    from sklearn.decomposition import NMF

    stand_in = "tensorflow" not in sys.modules
    sys.modules.setdefault("tensorflow", types.ModuleType("tensorflow"))  # imported by a sampler not used here
    from craft.craft_torch import Craft as PeerCraft

    if stand_in:  # gone again: torch's compiler looks up every module it is told of
        del sys.modules["tensorflow"]
    before = nn.Sequential(model.conv_stem, model.bn1, model.blocks, model.conv_head, model.bn2)

    def after(a: torch.Tensor) -> torch.Tensor:
        return model.classifier(model.global_pool(a).flatten(1))

    ours = Craft(model, "bn2", concepts=CONCEPTS, crop=CROP, batch_size=BATCH)
    bank = ours.fit(images)
    crops = cut(images, bank.boxes)
    with torch.no_grad():
        activations = torch.cat([before(part).mean(dim=(2, 3)) for part in crops.split(BATCH)])
    peer = PeerCraft(before, after, CONCEPTS, batch_size=BATCH, patch_size=CROP, device="cpu")
    peer.reducer = NMF(n_components=CONCEPTS).fit(activations.numpy())
    peer.W = np.asarray(peer.reducer.components_, dtype=np.float32)
    pooled = activations.double()

    def peer_whole() -> object:
        craft = PeerCraft(before, after, CONCEPTS, batch_size=BATCH, patch_size=CROP, device="cpu")
        craft.fit(images)
        return craft.estimate_importance(images, label, nb_design=DESIGNS)

    def ours_whole() -> object:
        craft = Craft(model, "bn2", concepts=CONCEPTS, crop=CROP, batch_size=BATCH)
        return craft.importance(craft.fit(images), images, label, designs=DESIGNS)

    return [
        ("CRAFT factorization (the same activations)", {
            "peer": lambda: NMF(n_components=CONCEPTS).fit_transform(activations.numpy()),
            "ours": lambda: factorize(lambda: iter([pooled]), CONCEPTS, 200),
        }, 5.0),
        ("CRAFT importance (the same images and concepts)", {
            "peer": lambda: peer.estimate_importance(images, label, nb_design=DESIGNS),
            "ours": lambda: ours.importance(bank, images, label, designs=DESIGNS),
        }, 5.0),
        ("CRAFT whole (crops read, fit, importance)", {"peer": peer_whole, "ours": ours_whole}, 5.0),
    ]  # fmt: skip


def crp_rows() -> dict[str, Callable[[], object]] | None:
    """explain's 16 concept maps in one call and zennit-crp's 16 calls; None where zennit-crp does not import."""
    try:
        from crp.attribution import CondAttribution
        from zennit.canonizers import SequentialMergeBatchNorm
        from zennit.composites import EpsilonPlus
    except ImportError:
        return None
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.vgg11_bn(num_classes=10).eval()
    x = torch.randn(1, 3, 64, 64)
    channels = list(range(16))

    def peer() -> object:
        attribution = CondAttribution(model)
        composite = EpsilonPlus(canonizers=[SequentialMergeBatchNorm()])
        return [
            attribution(x.requires_grad_(True), [{"features.4": [c], "y": [1]}], composite).heatmap for c in channels
        ]

    def ours() -> object:
        return ConceptRelevance(model, "features.4", [[c] for c in channels])(x, 1)

    return {"zennit-crp 0.6, 16 calls": peer, "explain ConceptRelevance, K = 16": ours}


def tcav_rows(model: nn.Module, images: torch.Tensor, label: int, runs: int = 5) -> dict[str, Callable[[], object]]:
    """explain's TCAV with its significance and Captum's over the same concept sets."""
    from captum.concept import TCAV as CaptumTCAV
    from captum.concept import Concept
    from captum.concept._utils.data_iterator import dataset_to_dataloader

    generator = torch.Generator().manual_seed(0)
    concept = images[: len(images) // 2] + 0.5 * torch.rand(len(images) // 2, 3, 1, 1, generator=generator)
    random = torch.randn(16, *images.shape[1:], generator=generator)
    halves = [torch.randperm(len(random), generator=generator) for _ in range(runs)]

    def peer() -> object:
        def made(index: int, data: torch.Tensor) -> Concept:
            return Concept(index, f"c{index}", dataset_to_dataloader(torch.utils.data.TensorDataset(data)))

        ours_concept, sets = made(0, concept), []
        for r, order in enumerate(halves):
            first, second = made(2 * r + 1, random[order[:8]]), made(2 * r + 2, random[order[8:]])
            sets += [[ours_concept, first], [first, second]]
        with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return CaptumTCAV(model, ["bn2"], save_path=folder).interpret(images, sets, target=label)

    def ours() -> object:
        return TCAV(model, "bn2", runs=runs)(images, concept, random, label)

    return {f"Captum 0.9 TCAV ({2 * runs} sets)": peer, f"explain TCAV ({runs} runs + null)": ours}


def streamed(crops: int, channels: int = 1280, batch: int = 1024) -> Callable[[], object]:
    """The factorization of ``crops`` random non-negative activations made batch by batch as they are read."""

    def batches():
        for start in range(0, crops, batch):
            generator = torch.Generator().manual_seed(start)
            yield torch.rand(min(batch, crops - start), channels, generator=generator, dtype=torch.float64) ** 4

    return lambda: factorize(batches, CONCEPTS, 20)


def main() -> None:
    args = rounds_and_out(__doc__)
    stolen = stolen_share()
    torch.set_num_threads(2)
    streamed(1024)()  # the linear algebra's one-time workspaces, outside the measurement
    memory = {crops: peak_mib(streamed(crops)) for crops in (4096, 16384, 65536)}  # first: a heap not yet cut up
    model, images, label = lite0_images()
    lines = [f"{len(images)} images (224x224), class {label}; medians of {args.rounds} interleaved rounds, seconds", ""]
    contests = [*craft_rows(model, images, label), ("TCAV", tcav_rows(model, images, label), 5.0)]
    crp = crp_rows()
    if crp is not None:
        contests.append(("CRP, K = 16", crp, 3.0))
    lines += ["| contest | peer (s) | explain (s) | peer / explain | target |", "|---|---:|---:|---:|---:|"]
    for name, runs, target in contests:
        medians = list(interleaved_medians(runs, args.rounds).values())
        ratio = medians[0] / medians[1]
        lines.append(f"| {name} | {medians[0]:.2f} | {medians[1]:.2f} | {ratio:.1f}x | {target:.0f}x |")
    if crp is None:
        lines.append("| CRP | zennit-crp does not import here (it pins zennit<=0.4.6): run in its venv | | | 3x |")
    lines += ["", "| crops streamed | factorization peak (MiB) |", "|---:|---:|"]
    lines += [f"| {crops} | {peak:.0f} |" for crops, peak in memory.items()]
    lines += ["", f"CPU time stolen by the host meanwhile: {stolen()}"]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
