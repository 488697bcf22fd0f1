"""AttnLRP's cost against the model's own forward and backward, ratios in one process (the CPU).

- **The cost of the rules**: ``explain.METHODS["attnlrp"]`` and ``["cplrp"]`` on a ViT-Small-shaped timm ViT
  (random weights, 224 pixels, patches of 16, 12 blocks of width 384, batch of 4), against the same model's forward
  and backward of the same scores through plain autograd, its parameters frozen (``torch.autograd.grad`` of the
  summed class scores with respect to the input), and against ``lrp`` and the engine's own plain gradient
  (``saliency``: what any call of the engine costs over bare autograd). Target: AttnLRP at most 1.15x the forward
  and backward.
- **Memory**: each call's peak resident memory over the process's, beside the forward and backward's.
- **Per word of an answer**: AttnLRP of a small random LLaVA-style model's 16-token answer (the model of
  ``bench_vision_language.py``: a CLIP tower of 4 layers at 224 pixels, a Llama of 4 layers), every word in one call
  (one forward, sixteen backward passes) against sixteen one-word calls. Target: at most 0.75x.

- **LRP against zennit**: ``lrp`` (EpsilonPlus) on a torchvision ResNet-50 (random weights, batch norms calibrated,
  2 images of 224x224) against zennit's EpsilonPlus with its ``ResNetCanonizer``, the same process, with each call's
  peak memory. Target: at most zennit's time.

- **Against LXT**: CP-LRP on a torchvision ViT of ViT-Small's shape, explain's and LXT 2.1's own (its torchvision ViT
  patch, loaded as its files alone in a process of its own: LXT's package as a whole does not import beside current
  ``transformers``), each against the forward and backward of the same process. LXT computes Gradient x Input of a
  patched model: its cost is the floor any CP-LRP can reach.

    python benchmarks/bench_attnlrp.py [--rounds 5] [--out benchmarks/results_attnlrp_cpu.md]
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from timing import emit, interleaved_medians, peak_mib, rounds_and_out, stolen_share

import explain
from explain.models import VisionLanguage
from explain.targets import TokenTarget

CLASSES = [1, 2, 3, 4]


def vit_small() -> torch.nn.Module:
    """A ViT-Small-shaped timm ViT with seeded random weights, in eval mode, its parameters frozen: the plain
    backward computes the input's gradient alone, as the methods' do (and LXT's process)."""
    import timm

    torch.manual_seed(0)
    return timm.create_model("vit_small_patch16_224", pretrained=False, num_classes=10).eval().requires_grad_(False)


def runs(model: torch.nn.Module, x: torch.Tensor) -> dict[str, Callable[[], object]]:
    """The plain forward and backward, AttnLRP, CP-LRP and LRP on the same model, images and classes."""
    methods = {name: explain.METHODS[name](model) for name in ("saliency", "attnlrp", "cplrp", "lrp")}

    def plain() -> object:
        leaf = x.clone().requires_grad_(True)
        scores = model(leaf)[torch.arange(len(x)), CLASSES].sum()
        return torch.autograd.grad(scores, leaf)[0]

    return {
        "forward + backward": plain,
        **{name: (lambda method=method: method(x, CLASSES, normalize=False)) for name, method in methods.items()},
    }


LXT_TIMING = """
import importlib.util, json, sys, types, torch
sys.path.insert(0, sys.argv[2])
from timing import interleaved_medians, peak_mib
from torchvision.models import vision_transformer
root = importlib.util.find_spec("lxt").submodule_search_locations[0]
for name, folder in (("lxt", ""), ("lxt.efficient", "/efficient"), ("lxt.efficient.models", "/efficient/models")):
    package = types.ModuleType(name)
    package.__path__ = [root + folder]
    sys.modules[name] = package
from lxt.efficient.models.vit_torch import cp_LRP
torch.set_num_threads(2)
torch.manual_seed(0)
model = vision_transformer.VisionTransformer(224, 16, 12, 6, 384, 1536, num_classes=10).eval().requires_grad_(False)
x = torch.randn(4, 3, 224, 224, generator=torch.Generator().manual_seed(1))
def run():
    leaf = x.clone().requires_grad_(True)
    scores = model(leaf)[torch.arange(4), torch.tensor([1, 2, 3, 4])].sum()
    return leaf * torch.autograd.grad(scores, leaf)[0]
plain = interleaved_medians({"forward + backward": run}, int(sys.argv[1]))
plain_memory = peak_mib(run)
for module, patch in cp_LRP.items():
    patch(module)
patched = interleaved_medians({"LXT cp-lrp": run}, int(sys.argv[1]))
memory = {"forward + backward MiB": plain_memory, "LXT cp-lrp MiB": peak_mib(run)}
print(json.dumps({**plain, **patched, **memory}))
"""


def against_lxt(rounds: int) -> list[str]:
    """CP-LRP on a torchvision ViT of ViT-Small's shape: explain's, and LXT's in a process of its own, each against
    its process's forward and backward: the table's lines (none where LXT is not installed)."""
    import torchvision

    try:
        found = subprocess.run(
            [sys.executable, "-c", LXT_TIMING, str(rounds), str(Path(__file__).parent)],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
    except subprocess.CalledProcessError as error:
        return [f"LXT not timed: {error.stderr.strip().splitlines()[-1]}"]
    lxt = json.loads(found.stdout.strip().splitlines()[-1])
    torch.manual_seed(0)
    model = torchvision.models.VisionTransformer(224, 16, 12, 6, 384, 1536, num_classes=10).eval()
    model.requires_grad_(False)  # as LXT's process holds it
    x = torch.randn(len(CLASSES), 3, 224, 224, generator=torch.Generator().manual_seed(1))
    contest = {k: v for k, v in runs(model, x).items() if k in ("forward + backward", "cplrp")}
    ours = interleaved_medians(contest, rounds)
    memory = {name: peak_mib(run) for name, run in contest.items()}
    lines = [
        "Against LXT: torchvision ViT of ViT-Small's shape, 4 images of 224x224, each against its own process's "
        f"forward + backward; medians of {rounds} rounds",
        "",
        "| call | seconds | / forward + backward | peak memory (MiB) | its forward + backward's (MiB) |",
        "|---|---:|---:|---:|---:|",
        f"| explain cplrp | {ours['cplrp']:.3f} | {ours['cplrp'] / ours['forward + backward']:.2f}x | "
        f"{memory['cplrp']:.0f} | {memory['forward + backward']:.0f} |",
        f"| LXT cp-lrp (its own process) | {lxt['LXT cp-lrp']:.3f} | "
        f"{lxt['LXT cp-lrp'] / lxt['forward + backward']:.2f}x | {lxt['LXT cp-lrp MiB']:.0f} | "
        f"{lxt['forward + backward MiB']:.0f} |",
    ]
    return lines


def lrp_against_zennit(rounds: int) -> list[str]:
    """LRP's EpsilonPlus on a ResNet-50, explain's and zennit's with its ResNet canonizer: the table's lines."""
    import torchvision
    from zennit.attribution import Gradient
    from zennit.composites import EpsilonPlus
    from zennit.torchvision import ResNetCanonizer

    torch.manual_seed(0)
    model = torchvision.models.resnet50(num_classes=10).eval()
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    onehot = torch.eye(10)[CLASSES[:2]]
    ours = explain.METHODS["lrp"](model)

    def zennit() -> object:
        with Gradient(model=model, composite=EpsilonPlus(canonizers=[ResNetCanonizer()])) as attributor:
            return attributor(x, onehot)[1]

    contest = {"explain lrp": lambda: ours(x, CLASSES[:2], normalize=False), "zennit EpsilonPlus": zennit}
    memory = {name: peak_mib(run) for name, run in contest.items()}
    medians = interleaved_medians(contest, rounds)
    base = medians["zennit EpsilonPlus"]
    lines = [
        f"LRP (EpsilonPlus) on a torchvision ResNet-50, 2 images of 224x224; medians of {rounds} interleaved rounds",
        "",
        "| call | seconds | / zennit | peak memory (MiB) |",
        "|---|---:|---:|---:|",
    ]
    lines += [f"| {name} | {t:.3f} | {t / base:.2f}x | {memory[name]:.0f} |" for name, t in medians.items()]
    return [*lines, "", "Target: explain's lrp at most zennit's time."]


def per_word(rounds: int) -> list[str]:
    """AttnLRP of every word of a 16-token answer in one call against sixteen one-word calls: the table's lines."""
    from bench_vision_language import ANSWER, IMAGE_TOKEN, small_llava

    model = small_llava()
    x = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    prompt = [1, 306, 4966, 29901, *[IMAGE_TOKEN] * 256, 1724, 338, 373, 278, 1591, 29973]
    answer = torch.randint(100, 31000, (ANSWER,), generator=torch.Generator().manual_seed(2)).tolist()
    sequence = torch.tensor(prompt + answer)
    positions = list(range(len(prompt), len(sequence)))
    method = explain.METHODS["attnlrp"](VisionLanguage(model, {"input_ids": sequence[None]}))
    contest = {
        "one word": lambda: method(x, TokenTarget(sequence, positions[:1]), normalize=False),
        "16 words, one call": lambda: method(x, TokenTarget(sequence, positions), normalize=False),
        "16 one-word calls": lambda: [method(x, TokenTarget(sequence, [p]), normalize=False) for p in positions],
    }
    medians = interleaved_medians(contest, rounds)
    base = medians["16 one-word calls"]
    lines = [
        f"Per word: a LLaVA-style model (CLIP tower of 4 layers, 256 vision tokens; Llama of 4 layers), "
        f"{len(sequence)} tokens, {ANSWER} of the answer; medians of {rounds} interleaved rounds",
        "",
        "| call | seconds | / 16 one-word calls |",
        "|---|---:|---:|",
    ]
    lines += [f"| {name} | {t:.3f} | {t / base:.2f}x |" for name, t in medians.items()]
    return [*lines, "", "Target: the 16 words of one call at most 0.75x sixteen one-word calls."]


def main() -> None:
    args = rounds_and_out(__doc__)
    stolen = stolen_share()
    torch.set_num_threads(2)
    model, x = vit_small(), torch.randn(len(CLASSES), 3, 224, 224, generator=torch.Generator().manual_seed(1))
    contest = runs(model, x)
    for run in contest.values():
        run()  # one-time workspaces and traces, outside the measurement
    memory = {name: peak_mib(run) for name, run in contest.items()}
    medians = interleaved_medians(contest, args.rounds)
    base = medians["forward + backward"]
    lines = [
        f"ViT-Small shape (12 blocks, width 384), {len(x)} images of 224x224; medians of {args.rounds} interleaved "
        "rounds",
        "",
        "| call | seconds | / forward + backward | peak memory (MiB) |",
        "|---|---:|---:|---:|",
    ]
    lines += [f"| {name} | {t:.3f} | {t / base:.2f}x | {memory[name]:.0f} |" for name, t in medians.items()]
    lines += ["", "Targets: attnlrp at most 1.15x the forward and backward; cplrp at most LXT's time (below).", ""]
    lines += [*lrp_against_zennit(args.rounds), "", *against_lxt(args.rounds), "", *per_word(args.rounds)]
    lines += ["", f"CPU time stolen: {stolen()}"]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
