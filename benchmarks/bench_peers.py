"""The methods explain shares with one peer each, against that peer's, same model, input, target and options.

pytorch-grad-cam 1.5: FullGrad, KPCA-CAM, ShapleyCAM, Finer-CAM, RefineCAM, FEM, Seg-Eigen-CAM and SESS on resnet18
(random weights, 224x224, batch 4, SESS one image and three scales); torchcam 0.5: LeGrad on a ViT-S/16-sized
torchvision ViT (224x224, batch 2); zennit 0.5: LRP's EpsilonPlus with batch norms merged on VGG-11-BN (160x160,
batch 2); Captum 0.9: DeepLift (on the VGG: Captum refuses resnet18's ReLU modules, called twice), GradientSHAP
(20 samples), and Feature Ablation, LIME and Kernel SHAP over 49 square segments (one image, 200 samples; Captum
at its default of one copy per forward, explain 16). One process,
rounds interleaved, medians and peak tensor memory of one call. Target: no method slower than its peer; a
batched perturbation method at least 2x faster than the peer's default.

    python benchmarks/bench_peers.py [--rounds 3] [--out benchmarks/results_peers_cpu.md]
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torchvision
from bench_gradcam import peak_memory
from timing import emit, interleaved_medians, resnet18_batch, rounds_and_out

import explain


def grad_cam_pairs(model: torch.nn.Module, x: torch.Tensor, target: list[int]) -> dict[str, tuple]:
    import pytorch_grad_cam as pgc
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

    targets = [ClassifierOutputTarget(t) for t in target]

    def peer(cls: type, layers: list, **options: object) -> Callable[[], object]:
        return lambda: cls(model=model, target_layers=layers, **options)(input_tensor=x, targets=targets)

    def peer_on(images: torch.Tensor, cls: type, layers: list, **options: object) -> Callable[[], object]:
        return lambda: cls(model, layers, **options)(input_tensor=images, targets=targets[: len(images)])

    ours = {
        name: explain.create_method(name, model, "layer4") for name in ("kpcacam", "shapleycam", "fem", "segeigencam")
    }
    finer, fullgrad = explain.create_method("finercam", model, "layer4"), explain.create_method("fullgrad", model)
    refine = explain.create_method("refinecam", model, ["layer2", "layer3", "layer4"])
    sess = explain.create_method("sess", model, "layer4", scales=[224, 288, 352])
    return {
        "FullGrad": (lambda: fullgrad(x, target), peer(pgc.FullGrad, [])),
        "KPCA-CAM": (lambda: ours["kpcacam"](x, target), peer(pgc.KPCA_CAM, [model.layer4])),
        "ShapleyCAM": (lambda: ours["shapleycam"](x, target), peer(pgc.ShapleyCAM, [model.layer4])),
        "Finer-CAM": (lambda: finer(x), lambda: pgc.FinerCAM(model, [model.layer4])(input_tensor=x, targets=None)),
        "RefineCAM": (lambda: refine(x, target), peer(pgc.RefineCAM, [model.layer2, model.layer3, model.layer4])),
        "FEM": (lambda: ours["fem"](x, target), peer(pgc.FEM, [model.layer4])),
        "Seg-Eigen-CAM": (lambda: ours["segeigencam"](x, target), peer(pgc.SegEigenCAM, [model.layer4])),
        "SESS (1 image, 3 scales)": (
            lambda: sess(x[:1], target[:1]),
            peer_on(x[:1], pgc.SESS, [model.layer4], scales=[224, 288, 352]),
        ),
    }


def torchcam_pairs() -> tuple[dict[str, tuple], torch.Tensor]:
    from torchcam.methods import LeGrad as TorchcamLeGrad

    torch.manual_seed(0)
    vit = torchvision.models.VisionTransformer(224, 16, 12, 6, 384, 1536, num_classes=1000).eval()
    torch.nn.init.normal_(vit.heads.head.weight, std=0.02)  # torchvision starts from a zero head
    x = torch.randn(2, 3, 224, 224)
    legrad = explain.methods.LeGrad(vit)

    def theirs() -> object:
        with TorchcamLeGrad(vit, list(vit.encoder.layers)) as extractor:
            return extractor([1, 2], vit(x))

    return {"LeGrad (ViT-S/16)": (lambda: legrad(x, [1, 2]), theirs)}, x


def vgg_and_input() -> tuple[torch.nn.Module, torch.Tensor]:
    """VGG-11-BN with random weights, and two 160x160 inputs: a network whose every ReLU module runs once, which
    zennit's rules and Captum's DeepLift need."""
    torch.manual_seed(0)
    return torchvision.models.vgg11_bn(num_classes=1000).eval(), torch.randn(2, 3, 160, 160)


def zennit_pairs() -> tuple[dict[str, tuple], torch.Tensor]:
    from zennit.attribution import Gradient
    from zennit.canonizers import SequentialMergeBatchNorm
    from zennit.composites import EpsilonPlus

    vgg, x = vgg_and_input()
    lrp = explain.methods.LRP(vgg)

    def theirs() -> object:
        with Gradient(model=vgg, composite=EpsilonPlus(canonizers=[SequentialMergeBatchNorm()])) as attributor:
            return attributor(x, torch.eye(1000)[[1, 2]])

    return {"LRP EpsilonPlus (VGG-11-BN)": (lambda: lrp(x, [1, 2]), theirs)}, x


def captum_pairs(model: torch.nn.Module, x: torch.Tensor, target: list[int]) -> dict[str, tuple]:
    from captum import attr

    cell = torch.arange(224) * 7 // 224
    segments = cell[:, None] * 7 + cell[None, :]  # 49 squares
    one, first = x[:1], target[:1]
    baselines = torch.zeros(4, *x.shape[1:])
    vgg, pair = vgg_and_input()
    ours = {
        "deeplift": explain.methods.DeepLift(vgg),
        "gradient_shap": explain.methods.GradientSHAP(model, baselines=baselines, samples=20, batch_size=16, seed=0),
        "feature_ablation": explain.methods.FeatureAblation(model, segments=segments),
        "lime": explain.methods.LIME(model, segments=segments, samples=200, seed=0),
        "kernel_shap": explain.methods.KernelSHAP(model, segments=segments, samples=200, seed=0),
    }
    mask = segments[None, None]
    return {
        "DeepLift (VGG-11-BN)": (
            lambda: ours["deeplift"](pair, [1, 2]),
            lambda: attr.DeepLift(vgg).attribute(pair, target=[1, 2]),
        ),
        "GradientSHAP, 20 samples": (
            lambda: ours["gradient_shap"](x, target),
            lambda: attr.GradientShap(model).attribute(x, baselines=baselines, n_samples=20, target=target),
        ),
        "Feature Ablation, 49 segments": (
            lambda: ours["feature_ablation"](one, first),
            lambda: attr.FeatureAblation(model).attribute(one, target=first, feature_mask=mask),
        ),
        "LIME, 200 samples": (
            lambda: ours["lime"](one, first),
            lambda: attr.Lime(model).attribute(one, target=first, feature_mask=mask, n_samples=200),
        ),
        "Kernel SHAP, 200 samples": (
            lambda: ours["kernel_shap"](one, first),
            lambda: attr.KernelShap(model).attribute(one, target=first, feature_mask=mask, n_samples=200),
        ),
    }


def main() -> None:
    args = rounds_and_out(__doc__)
    model, x, target = resnet18_batch()
    groups = [
        ("pytorch-grad-cam", grad_cam_pairs(model, x, target), x),
        ("torchcam", *torchcam_pairs()),
        ("zennit", *zennit_pairs()),
        ("Captum", captum_pairs(model, x, target), x),
    ]
    lines = [
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU, median of {args.rounds} interleaved "
        "rounds; memory: peak tensor memory of one call.",
        "",
        "| method | peer | explain (ms) | peer (ms) | × peer | explain memory (MiB) | × peer |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for peer, pairs, inputs in groups:
        for name, (ours, theirs) in pairs.items():
            medians = interleaved_medians({"explain": ours, peer: theirs}, args.rounds)
            memory = {
                who: peak_memory(lambda _, run=run: run(), inputs) for who, run in (("explain", ours), (peer, theirs))
            }
            lines.append(
                f"| {name} | {peer} | {1000 * medians['explain']:.0f} | {1000 * medians[peer]:.0f} "
                f"| {medians['explain'] / medians[peer]:.2f} | {memory['explain'] / 2**20:.0f} "
                f"| {memory['explain'] / max(memory[peer], 1):.2f} |"
            )
            print(lines[-1], flush=True)
    emit(lines, args.out)


if __name__ == "__main__":
    main()
