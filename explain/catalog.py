"""What ``explain`` offers by name, readable without importing torch (``explain --method list``, ``--help``).

The method classes live in :mod:`explain.methods`, which builds ``explain.METHODS`` from this
list; each class's ``name`` is its entry's name (a test holds the two together).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from .errors import ExplainError

FUSIONS = ("mean", "max", "product")  # how several layers' maps become one (``fuse=``, ``--fuse``)


@dataclass(frozen=True)
class MethodEntry:
    """One CAM method.

    Attributes:
        name: The name the API and the CLI take (``method="gradcampp"``).
        cls: Its class's name in :mod:`explain.methods`.
        title: What it is, in a few words, with its paper.
        fast: One forward and at most one backward per target: part of ``--method all``.
        cost: What makes a call slow, for a method of many passes (the explorer shows it); None for the others.
    """

    name: str
    cls: str
    title: str
    fast: bool = True
    cost: str | None = None


METHOD_CATALOG: tuple[MethodEntry, ...] = (
    MethodEntry("gradcam", "GradCAM", "Grad-CAM (Selvaraju et al. 2017)"),
    MethodEntry("gradcampp", "GradCAMPlusPlus", "Grad-CAM++ (Chattopadhyay et al. 2018)"),
    MethodEntry("xgradcam", "XGradCAM", "XGrad-CAM (Fu et al. 2020)"),
    MethodEntry("hirescam", "HiResCAM", "HiResCAM (Draelos & Carin 2020)"),
    MethodEntry("gradcam_elementwise", "GradCAMElementWise", "Grad-CAM, element-wise ReLU"),
    MethodEntry("layercam", "LayerCAM", "LayerCAM (Jiang et al. 2021)"),
    MethodEntry("eigencam", "EigenCAM", "Eigen-CAM (Muhammad & Yeasin 2020)"),
    MethodEntry("eigengradcam", "EigenGradCAM", "Eigen-Grad-CAM, principal component of g*A"),
    MethodEntry("segeigencam", "SegEigenCAM", "Seg-Eigen-CAM, principal component of |g|*A (Chung & Ying 2025)"),
    MethodEntry("kpcacam", "KPCACAM", "KPCA-CAM, kernel principal component (Karmani et al. 2024)"),
    MethodEntry("fem", "FEM", "FEM, channels' outstanding positions (Fuad et al. 2020)"),
    MethodEntry(
        "shapleycam",
        "ShapleyCAM",
        "ShapleyCAM, gradient and Hessian (Cai et al. 2025)",
        fast=False,
        cost="a second backward, through the Hessian",
    ),
    MethodEntry("finercam", "FinerCAM", "Finer-CAM, a class against its look-alikes (Zhang et al. 2025)"),
    MethodEntry("refinecam", "RefineCAM", "RefineCAM, Grad-CAM++ maps of layers multiplied", fast=False),
    MethodEntry(
        "sess",
        "SESS",
        "SESS, a method over scaled, slid windows (Tyagi et al. 2022)",
        fast=False,
        cost="the base method on every window at every scale",
    ),
    MethodEntry("fullgrad", "FullGrad", "FullGrad, input and bias gradients (Srinivas & Fleuret 2019)", fast=False),
    MethodEntry(
        "dff", "DeepFeatureFactorization", "Deep Feature Factorization, NMF concepts (Collins et al. 2018)", fast=False
    ),
    MethodEntry("cam", "OriginalCAM", "CAM (Zhou et al. 2016)"),
    MethodEntry("guided_backprop", "GuidedBackprop", "Guided Backprop (Springenberg et al. 2015)"),
    MethodEntry("guided_gradcam", "GuidedGradCAM", "Guided Grad-CAM (Selvaraju et al. 2017)"),
    MethodEntry("deconvolution", "Deconvolution", "Deconvolution (Zeiler & Fergus 2014)"),
    MethodEntry("scorecam", "ScoreCAM", "Score-CAM (Wang et al. 2020)", fast=False, cost="one forward per channel"),
    MethodEntry(
        "sscam", "SSCAM", "SS-CAM (Wang et al. 2020)", fast=False, cost="a forward per channel and noise sample"
    ),
    MethodEntry(
        "iscam", "ISCAM", "IS-CAM (Naidu et al. 2020)", fast=False, cost="a forward per channel and integration step"
    ),
    MethodEntry(
        "ablationcam",
        "AblationCAM",
        "Ablation-CAM (Desai & Ramaswamy 2020)",
        fast=False,
        cost="one forward per channel",
    ),
    MethodEntry("random", "RandomCAM", "random channel weights, a baseline", fast=False),
    MethodEntry("attention_rollout", "AttentionRollout", "Attention Rollout (Abnar & Zuidema 2020)", fast=False),
    MethodEntry("gradient_rollout", "GradientRollout", "Gradient-weighted rollout (Chefer et al. 2021)", fast=False),
    MethodEntry(
        "chefer", "CheferRelevance", "Chefer 2021a, relevance and gradient rolled out (Chefer et al. 2021)", fast=False
    ),
    MethodEntry(
        "legrad",
        "LeGrad",
        "LeGrad, each block's read-out at its attention (Bousselham et al. 2024)",
        fast=False,
        cost="a backward per block",
    ),
    MethodEntry("saliency", "Saliency", "Saliency, the input's gradient (Simonyan et al. 2014)"),
    MethodEntry("input_x_gradient", "InputXGradient", "Input x Gradient (Shrikumar et al. 2016)"),
    MethodEntry(
        "integrated_gradients",
        "IntegratedGradients",
        "Integrated Gradients (Sundararajan et al. 2017)",
        fast=False,
        cost="a forward and backward per step",
    ),
    MethodEntry("lrp", "LRP", "Layer-wise relevance propagation, zennit's composites (Bach et al. 2015)"),
    MethodEntry("deeplift", "DeepLift", "DeepLift, the rescale rule (Shrikumar et al. 2017)", fast=False),
    MethodEntry(
        "gradient_shap",
        "GradientSHAP",
        "GradientSHAP, expected gradients (Lundberg & Lee 2017)",
        fast=False,
        cost="a forward and backward per sample",
    ),
    MethodEntry("sobel", "SobelCAM", "Sobel-CAM, the input's edges: a baseline", fast=False),
    MethodEntry(
        "occlusion",
        "Occlusion",
        "Occlusion, sliding windows (Zeiler & Fergus 2014)",
        fast=False,
        cost="one forward per window placement",
    ),
    MethodEntry(
        "rise", "RISE", "RISE, random masks (Petsiuk et al. 2018)", fast=False, cost="one forward per random mask"
    ),
    MethodEntry(
        "feature_ablation",
        "FeatureAblation",
        "Feature Ablation over superpixels",
        fast=False,
        cost="one forward per superpixel",
    ),
    MethodEntry(
        "lime", "LIME", "LIME over superpixels (Ribeiro et al. 2016)", fast=False, cost="one forward per sample"
    ),
    MethodEntry(
        "kernel_shap",
        "KernelSHAP",
        "Kernel SHAP over superpixels (Lundberg & Lee 2017)",
        fast=False,
        cost="one forward per sample",
    ),
)

METHOD_NAMES = [entry.name for entry in METHOD_CATALOG]
FAST_METHOD_NAMES = [entry.name for entry in METHOD_CATALOG if entry.fast]  # what ``--method all`` compares
ALL_METHODS = "all"  # the CLI's name for one comparison grid of every fast method per image


@dataclass(frozen=True)
class MetricEntry:
    """One faithfulness metric of ``--metrics`` (see :mod:`explain.metrics`).

    Attributes:
        name: The name ``--metrics`` takes.
        title: What each image's value is.
        better: ``"lower"`` or ``"higher"``: which way a more faithful map moves it.
    """

    name: str
    title: str
    better: str


METRIC_CATALOG: tuple[MetricEntry, ...] = (
    MetricEntry("deletion", "deletion AUC (RISE)", "lower"),
    MetricEntry("insertion", "insertion AUC (RISE)", "higher"),
    MetricEntry("drop", "Average Drop, %", "lower"),
    MetricEntry("increase", "Increase in Confidence, %", "higher"),
    MetricEntry("gain", "Average Gain, %", "higher"),
    MetricEntry("road", "ROAD, (LeRF - MoRF) / 2", "higher"),
)
METRIC_NAMES = [entry.name for entry in METRIC_CATALOG]


def check_metrics(text: str) -> list[str]:
    """The metric names of a comma-separated list, in catalog order.

    Raises:
        ExplainError: A name is not a metric's.
    """
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in METRIC_NAMES]
    if unknown or not names:
        raise ExplainError(
            f"unknown metric(s) {', '.join(map(repr, unknown)) or 'none given'}; known: {', '.join(METRIC_NAMES)}"
        )
    return [name for name in METRIC_NAMES if name in names]


def check_method(name: str) -> None:
    """Refuse a name that is not a method's, suggesting close ones.

    Raises:
        ExplainError: The name is unknown.
    """
    if name not in METHOD_NAMES:
        close = difflib.get_close_matches(name, METHOD_NAMES, n=3, cutoff=0.5)
        hint = f"did you mean: {', '.join(close)}" if close else f"known: {', '.join(METHOD_NAMES)}"
        raise ExplainError(f"unknown method {name!r}; {hint}")


def method_table() -> str:
    """One line per method: its name, what it is, and whether ``--method all`` includes it."""
    rows = []
    for entry in METHOD_CATALOG:
        cost = "fast, in --method all" if entry.fast else "not in --method all"
        rows.append(f"{entry.name:20} {entry.title:45} {cost}")
    return "\n".join(rows)
