"""The house's rules: dependency directions read from the imports, targets bound once on the plain pass, settings
parsed once with the task rules in the library, one scorer per batch for every metric, and the folded scoring copy
built once per model."""

from __future__ import annotations

import ast
import contextlib
import gc
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import CAT, manifest, seeded
from torch import nn

import explain
from explain import metrics
from explain.core.speedups import folding
from explain.export.settings import ExportOptions, MethodSelection, RenderOptions
from explain.metrics import scoring

PACKAGE = Path(explain.__file__).parent


def imported_modules(path: Path) -> set[str]:
    """The explain modules a file imports, as absolute dotted names (relative imports resolved)."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    package = package.removesuffix(".__init__")
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [f"{target}.{alias.name}" for alias in node.names]
            found |= {target, *names}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return {name for name in found if name == "explain" or name.startswith("explain.")}


def layer_of(module: str) -> str:
    """The subpackage (or top-level module) a dotted explain module belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


MODULES = {
    ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): path
    for path in PACKAGE.rglob("*.py")
}


DRAWING = "explain.io.render"  # core/result.py draws a result in Jupyter with it, when asked, and with it alone


def reached_from(module: str) -> set[str]:
    """Every explain module imported from ``module``, directly or through others."""
    seen, todo = set(), [module]
    while todo:
        for found in imported_modules(MODULES[todo.pop()]):
            known = found if found in MODULES else found.rpartition(".")[0]
            if known in MODULES and known not in seen:
                seen.add(known)
                todo.append(known)
    return seen


@pytest.mark.parametrize("low", ["core", "targets"])
def test_core_and_targets_never_import_export_io_or_the_cli(low) -> None:
    for name, path in MODULES.items():
        if layer_of(name) != low:
            continue
        imported = imported_modules(path)
        if name == "explain.core.result":
            imported -= {DRAWING, *reached_from(DRAWING)} | {m for m in imported if m.startswith(f"{DRAWING}.")}
        reached = {layer_of(m) for m in imported}
        assert not reached & {"export", "io", "cli"}, f"{name} imports {sorted(reached & {'export', 'io', 'cli'})}"


def test_what_a_result_draws_with_reaches_no_engine_export_or_front_end() -> None:
    """The one way from the core to I/O leads to drawing, which leads back to nothing above it."""
    reached = reached_from(DRAWING)
    assert {layer_of(m) for m in reached} <= {"io", "errors", "warning_filters"}, sorted(reached)
    assert any(m == DRAWING or m.startswith(f"{DRAWING}.") for m in imported_modules(MODULES["explain.core.result"]))


FRONT_ENDS = {"cli", "__main__", "explorer", "notebook"}  # what a user runs: the command line, the app, the widgets
JOBS = {"export", "evaluation", "atlas"}  # runs that write an output folder: export, evaluate, concepts and tcav


def test_only_the_front_ends_import_the_jobs_and_none_imports_them() -> None:
    for name, path in MODULES.items():
        if layer_of(name) in {*JOBS, *FRONT_ENDS} or name == "explain":  # the package's lazy names are strings
            continue
        reached = {m for m in imported_modules(path) if layer_of(m) in {*JOBS, *FRONT_ENDS}}
        assert not reached, f"{name} imports {sorted(reached)}"


def test_targets_import_nothing_of_the_engine() -> None:
    for name, path in MODULES.items():
        if layer_of(name) == "targets":
            reached = {layer_of(m) for m in imported_modules(path)} - {"targets", "errors"}
            assert not reached, f"{name} imports {sorted(reached)}"


def test_the_rules_are_read_from_real_imports() -> None:
    """The reader sees relative imports at every depth: the check above cannot pass by reading nothing."""
    assert "explain.core.engine" in imported_modules(PACKAGE / "methods" / "gradient.py")
    assert "explain.export.run" in imported_modules(PACKAGE / "cli.py")
    assert "explain.explorer.session" in imported_modules(PACKAGE / "notebook.py")
    assert "explain.targets" in imported_modules(PACKAGE / "core" / "engine.py")


class Unreached(nn.Module):
    """A classifier whose ``side`` layer runs but reaches the score only through a product with zero."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.side = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        side = self.side(x)
        return self.head(self.features(x).mean(dim=(2, 3))) + 0 * side.sum(dim=(1, 2, 3))[:, None]


@pytest.mark.parametrize(
    "options", [{}, {"smooth_samples": 3}, {"aug_smooth": True}, {"smooth_samples": 2, "aug_smooth": True}]
)
def test_a_layer_the_score_does_not_reach_is_refused_on_every_path(options) -> None:
    torch.manual_seed(0)
    model, x = Unreached().eval(), torch.randn(2, 3, 16, 16)
    with pytest.raises(explain.LayerError, match=r"gradient is zero at every position of layer\(s\) side"):
        explain.GradCAM(model, "side", **options)(x)
    assert explain.GradCAM(model, "features", **options)(x).cams.shape == (2, 16, 16)


def test_a_bound_target_is_guarded_too() -> None:
    """A target bound by an earlier call (as Guided Grad-CAM passes it on) is scored as it is and still guarded."""
    torch.manual_seed(0)
    model, x = Unreached().eval(), torch.randn(2, 3, 16, 16)
    first = explain.GradCAM(model, "features")(x, target=[1, 3])
    again = explain.GradCAM(model, "features")(x, target=first.target)
    assert again.class_indices.tolist() == [1, 3] and torch.allclose(again.cams, first.cams)
    with pytest.raises(explain.LayerError, match="gradient is zero"):
        explain.GradCAM(model, "side")(x, target=first.target)


def test_smoothing_averages_noisy_copies_only() -> None:
    """With smoothing the plain pass only binds: the map is the mean of the noisy copies' maps, as before."""
    model, x = seeded("resnet18", num_classes=5), torch.randn(1, 3, 64, 64)
    smoothed = explain.GradCAM(model, "layer4", smooth_samples=3, seed=4)(x, target=2).raw
    generator = torch.Generator().manual_seed(4)
    spread = x.amax() - x.amin()
    copies = [x + 0.15 * spread * torch.randn(x.shape, generator=generator) for _ in range(3)]
    expected = torch.stack([explain.GradCAM(model, "layer4")(c, target=2, normalize=False).raw for c in copies])
    assert torch.allclose(smoothed, expected.mean(dim=0), atol=1e-5)


def test_a_metric_rescores_a_bound_target_as_the_class_itself() -> None:
    model, x = seeded("resnet18", num_classes=5), torch.randn(2, 3, 64, 64)
    result = explain.GradCAM(model, "layer4")(x, target=[4, 1])
    rescored = result.target.rescored("probability")
    with torch.no_grad():
        output = model(x)
    assert torch.allclose(rescored.score(output, torch.arange(2))[:, 0], output.softmax(1)[[0, 1], [4, 1]])
    by_bound = metrics.average_drop(model, x, result.cams, result.target)
    by_class = metrics.average_drop(model, x, result.cams, [4, 1])
    assert torch.allclose(by_bound.value, by_class.value)
    segmenting = explain.targets.RegressionTarget().bind(output, None)
    with pytest.raises(explain.TargetError, match="only a classifier's classes"):
        segmenting.rescored("logit")


def small_classifier() -> nn.Module:
    torch.manual_seed(1)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )
    with torch.no_grad():
        model[1].running_mean.normal_(0, 0.5)
        model[1].running_var.uniform_(0.5, 2.0)
    return model.eval()


def test_the_folded_copy_is_built_once_and_again_after_any_change(monkeypatch) -> None:
    model, x = small_classifier(), torch.randn(2, 3, 16, 16)
    built = []
    original = folding.folded
    monkeypatch.setattr(folding, "folded", lambda m: built.append(1) or original(m))
    maps = torch.rand(2, 4, 4)
    first = metrics.deletion(model, x, maps, steps=4).auc
    assert torch.allclose(metrics.deletion(model, x, maps, steps=4).auc, first) and len(built) == 1
    with torch.no_grad():
        model[0].weight.data.mul_(2)  # through .data: no version counter sees it
    changed = metrics.deletion(model, x, maps, steps=4).auc
    assert len(built) == 2 and not torch.allclose(changed, first)
    with torch.no_grad():  # the copy in use computes what the changed model itself computes
        assert torch.allclose(folding.folded_copy(model)(x), model(x), atol=1e-5)
    model[1].running_mean.add_(1.0)
    metrics.deletion(model, x, maps, steps=4)
    assert len(built) == 3


def test_the_folded_copy_dies_with_its_model() -> None:
    model = small_classifier()
    metrics.deletion(model, torch.randn(1, 3, 16, 16), torch.rand(1, 4, 4), steps=2)
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None


def test_the_bundled_norm_is_recognised_by_its_class() -> None:
    from explain.models.efficientnet_lite0 import BatchNormAct2d

    @folding.norm_with_activation
    class Elsewhere(nn.BatchNorm2d):  # the same kind of layer defined in another module
        def __init__(self, channels: int) -> None:
            super().__init__(channels)
            self.act = nn.ReLU6()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.act(super().forward(x))

    torch.manual_seed(0)
    for norm in (BatchNormAct2d(4), Elsewhere(4)):
        model = nn.Sequential(nn.Conv2d(3, 4, 3), norm).eval()
        with torch.no_grad():
            norm.running_mean.normal_()
        copy = folding.folded(model)
        assert not any(isinstance(m, nn.BatchNorm2d) for m in copy.modules())
        x = torch.randn(1, 3, 8, 8)
        with torch.no_grad():
            assert torch.allclose(copy(x), model(x), atol=1e-5)


def test_export_refuses_topk_and_metrics_on_a_detector(tmp_path) -> None:
    spec = explain.ModelSpec(
        nn.Conv2d(3, 1, 1),
        "a detector",
        ["a", "b"],
        explain.models.Preprocessing(None, (0,) * 3, (1,) * 3),
        "detection",
    )
    for options in (ExportOptions(topk=2), ExportOptions(metrics="deletion")):
        with pytest.raises(explain.ExplainError, match="detection model"):
            explain.export_heatmaps(spec, [CAT], tmp_path / "out", options)
    assert not (tmp_path / "out").exists()


def test_settings_are_checked_when_made() -> None:
    with pytest.raises(explain.ExplainError, match="exclude each other"):
        ExportOptions(topk=2, target=3)
    with pytest.raises(explain.ExplainError, match="unknown method 'gradcamm'"):
        ExportOptions(method="gradcam,gradcamm")
    with pytest.raises(explain.ExplainError, match="unknown colormap"):
        RenderOptions(colormap="nope")
    with pytest.raises(explain.ExplainError, match="drop --topk"):
        ExportOptions(method="all", topk=2)
    assert ExportOptions(metrics="insertion,deletion").metrics == ("deletion", "insertion")


def test_a_method_selection_gives_each_method_its_options() -> None:
    grid = MethodSelection.parse("all", {"aug_smooth": True, "samples": 4})
    assert grid.grid and grid.written == ["all"] and "scorecam" not in grid.names
    assert grid.options_for("gradcam") == {"aug_smooth": True}
    several = MethodSelection.parse("gradcam,sscam", {"samples": 4})
    assert several.options_for("sscam", batch_size=8) == {"samples": 4, "batch_size": 8}
    assert several.options_for("gradcam") == {}
    alone = MethodSelection.parse("gradcam", {"samples": 4})
    assert alone.options_for("gradcam") == {"samples": 4}  # refused by the method, with its own message
    with pytest.raises(explain.ExplainError, match="samples do not apply"):
        explain.create_method("gradcam", nn.Conv2d(3, 3, 1), **alone.options_for("gradcam"))


def test_an_export_of_six_metrics_builds_one_scorer_per_batch(tmp_path, monkeypatch) -> None:
    """Every metric of a batch's maps reads one scorer: one plain forward; the folded copy is built once."""
    from PIL import Image

    photos = tmp_path / "photos"
    photos.mkdir()
    for i in range(4):
        Image.fromarray(np.random.default_rng(i).integers(0, 255, (24, 24, 3), dtype=np.uint8)).save(
            photos / f"{i}.png"
        )
    spec = explain.ModelSpec(
        small_classifier(), "small", list("abcd"), explain.models.Preprocessing(16, (0.5,) * 3, (0.5,) * 3)
    )
    scorers, folds = [], []
    real_forwards, real_folded = scoring.ScoringForwards, folding.folded
    monkeypatch.setattr(scoring, "ScoringForwards", lambda *a, **k: scorers.append(1) or real_forwards(*a, **k))
    monkeypatch.setattr(folding, "folded", lambda m: folds.append(1) or real_folded(m))
    options = ExportOptions(metrics="deletion,insertion,drop,increase,gain,road", batch_size=2, workers=0)
    summary = explain.export_heatmaps(spec, [photos], tmp_path / "out", options)
    assert summary.written == 4 and len(scorers) == 2 and len(folds) == 1
    record = manifest(tmp_path / "out")[0]
    assert set(record["targets"][0]["metrics"]) == {"deletion", "insertion", "drop", "increase", "gain", "road"}


def test_no_function_of_the_package_is_over_60_lines() -> None:
    long = [
        f"{path.relative_to(PACKAGE.parent)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 60
    ]
    assert long == []


def test_the_explorers_controls_are_declared_once_and_built_by_both_front_ends(tmp_path) -> None:
    """The web page's components and the notebook's widgets are the declared controls, by name, with the same
    labels and options."""
    pytest.importorskip("gradio")
    pytest.importorskip("ipywidgets")
    from explain.explorer import Explorer, bundled_photos
    from explain.explorer.controls import CONTROLS
    from explain.explorer.web import App, build
    from explain.notebook import NotebookExplorer

    spec = explain.load_model("efficientnet_lite0")
    app = App(spec, explain.load_model)
    page = build(app)
    components = {block.elem_id: block for block in page.blocks.values() if getattr(block, "elem_id", None)}
    explorer = Explorer(spec)
    for path in bundled_photos():
        explorer.add(path)
    widgets = NotebookExplorer(explorer, tmp_path).controls
    assert list(widgets) == [control.name for control in CONTROLS]
    for control in CONTROLS:
        component, widget = components[control.name], widgets[control.name]
        assert component.label == widget.description == control.label_for(app.explorer)
        if control.kind == "menu" and control.options is not None:
            assert [value for _, value in component.choices] == [
                option[1] if isinstance(option, tuple) else option for option in widget.options
            ]
    assert components["typed"].visible and widgets["typed"].layout.display != "none"  # a classifier's classes
    assert not components["index"].visible and widgets["index"].layout.display == "none"  # no frames in a photo


KINDS = {"classification", "segmentation", "detection", "pose", "depth", "prompted", "answers", "detects", "scores",
         "prompts", "queries"}  # fmt: skip
"""The names of the kinds of output: only the tasks (explain/tasks) and the models that name their own kind
(explain/models) may say them."""


def kind_names(node: ast.AST) -> set[str]:
    """The kinds' names a comparison's operand holds: a string, or a tuple, list or set of them."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value} & KINDS
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {name for element in node.elts for name in kind_names(element)}
    return set()


def kind_tests(path: Path) -> list[str]:
    """Where a file compares something with a kind's name, or dispatches on kinds by a table keyed by them."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Compare):
            names = set().union(*(kind_names(operand) for operand in [node.left, *node.comparators]))
            if names:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} compares with {sorted(names)}")
        elif isinstance(node, ast.Dict):
            keys = {name for key in node.keys if key is not None for name in kind_names(key)}
            if len(keys) > 1:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} keys a table by {sorted(keys)}")
    return found


def test_no_kind_of_output_is_told_by_its_name_outside_the_tasks() -> None:
    """The front ends, the export, evaluate, the engine and the methods ask the task; none tests a kind's name."""
    found = [
        place
        for name, path in MODULES.items()
        if layer_of(name) not in {"tasks", "models"}
        for place in kind_tests(path)
    ]
    assert not found, "\n".join(found)
    assert kind_tests(PACKAGE / "tasks" / "registry.py")  # the check reads real tables: the registry's are found


@pytest.mark.parametrize("family", ["cnn", "vit"])
def test_no_method_keeps_a_calls_state_on_itself(family) -> None:
    """A method's attributes after a call are those it was built with; only the last call's layer, which ``layer``
    reports, is kept. A call's masks, windows or attention modules live in the call (Rollout's once did not)."""
    from test_speedups import FEWEST, ZOO

    model, x = ZOO[family](), torch.randn(1, 3, 64, 64)

    def state(method: object) -> dict[str, int]:
        return {key: id(value) for key, value in vars(method).items() if key != "_layers"}

    for name in explain.METHODS:
        options = FEWEST.get(name, {}) | ({"seed": 0} if "seed" in explain.methods.method_options(name) else {})
        method = explain.create_method(name, model, **options)
        before = state(method)
        with contextlib.suppress(explain.ExplainError):  # a refusal too must leave the method as it was
            method(x, 2)
        assert state(method) == before, name


PASS_STEPS = ("target_layers", "recorder", "layout", "layer_gradients", "record", "plain_pass")


def test_a_method_holds_its_formula_and_the_runner_its_passes() -> None:
    """No method defines how its passes record (its layers, its recorder, a layout, its gradients): it declares a
    recording in ``needs`` (explain.core.recording) and the runner asks that; the base class has none of these
    steps either."""
    from explain.core.engine import CAM
    from explain.core.recording import Recording

    for cls in [CAM, *(explain.methods.METHODS[name] for name in explain.METHODS)]:
        defined = [step for step in PASS_STEPS if any(step in vars(k) for k in cls.__mro__ if k is not object)]
        assert not defined, (cls.__name__, defined)
        assert isinstance(cls.needs.records, Recording), cls.__name__


def import_circles() -> list[list[str]]:
    """The package's import circles: each set of modules that import one another, directly or through others (any
    import, a function's and a type checker's included), as strongly connected components of the import graph."""
    graph = {name: set() for name in MODULES}
    for name, path in MODULES.items():
        for found in imported_modules(path):
            known = found if found in MODULES else found.rpartition(".")[0]  # a module, or a name of one
            if known in MODULES and known != name:
                graph[name].add(known)
    order, low, stack, circles = {}, {}, [], []

    def visit(module: str) -> None:
        order[module] = low[module] = len(order)
        stack.append(module)
        for other in graph[module]:
            if other not in order:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], order[other])
        if low[module] == order[module]:
            found = stack[stack.index(module) :]
            del stack[stack.index(module) :]
            if len(found) > 1:
                circles.append(sorted(found))

    for module in graph:
        if module not in order:
            visit(module)
    return circles


def test_no_module_imports_itself_through_others() -> None:
    assert import_circles() == []


def test_the_public_surface_is_read_in_one_screen() -> None:
    """At most 40 names at the top and 10 in explain.concepts; the names that left keep working one release, each
    with a warning that says where they went."""
    import explain.concepts

    assert len(explain.__all__) <= 40 and len(explain.concepts.__all__) <= 10
    assert set(explain.__all__) <= set(dir(explain)) and set(explain.concepts.__all__) <= set(dir(explain.concepts))
    assert "GradCAM" in explain.__all__ and "ScoreCAM" not in explain.__all__
    with pytest.warns(DeprecationWarning, match=r"explain\.ScoreCAM is deprecated.*explain\.methods\.ScoreCAM"):
        assert explain.ScoreCAM is explain.methods.ScoreCAM
    with pytest.warns(DeprecationWarning, match=r"explain\.concepts\.t_test.*explain\.concepts\.tcav\.t_test"):
        from explain.concepts import t_test
    from explain.concepts.tcav import t_test as moved

    assert t_test is moved
    with pytest.warns(DeprecationWarning, match="explain.CAM"):
        assert explain.methods.Method is explain.CAM


INPUT_KINDS = {"image", "video", "volume", "signal"}


def input_kind_tests(path: Path) -> list[str]:
    """Where a file compares a kind of input (anything named ``kind``) with a kind's name."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        names = {
            element.value
            for operand in operands
            for element in (operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand])
            if isinstance(element, ast.Constant) and element.value in INPUT_KINDS
        }
        asks_kind = any("kind" in ast.unparse(operand) for operand in operands)
        if names and asks_kind:
            found.append(f"{path.name}:{node.lineno} compares a kind with {sorted(names)}")
    return found


def test_no_kind_of_input_is_told_by_its_name_outside_its_object(tmp_path) -> None:
    """An image, a clip, a scan or a signal is asked what it is (explain.io.kinds), never tested by name."""
    found = [place for path in MODULES.values() for place in input_kind_tests(path)]
    assert not found, "\n".join(found)
    told = tmp_path / "told.py"  # the check finds the comparisons it forbids (as they were before the kinds)
    told.write_text('if photo.kind in ("video", "volume") or spec.preprocessing.kind != "image":\n    pass\n')
    assert len(input_kind_tests(told)) == 2


def test_the_runner_decides_records_and_maps_and_holds_no_speedup() -> None:
    """Every speedup lives in explain/core/speedups behind its switch: the runner asks in_pass whether its pass
    settles the automatic layer, and never reads a switch, a pending search or the traced pass itself."""
    runner = PACKAGE / "core" / "runner.py"
    speedups = {name for name in imported_modules(runner) if name.startswith("explain.core.speedups")}
    assert speedups <= {"explain.core.speedups.in_pass", *(f"explain.core.speedups.in_pass.{n}" for n in
                                                         ("Pending", "Traced", "in_pass"))}  # fmt: skip
    source = runner.read_text(encoding="utf-8")
    assert not any(word in source for word in ("enabled(", "pending_search", "traced_pass", "settled_pass"))


def test_the_explorers_pages_ask_the_task_what_a_click_does() -> None:
    """What a click does is the task's to say (its picks, prompts, regions, words); no page tests its name."""
    found = []
    for name, path in MODULES.items():
        if layer_of(name) == "tasks":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Compare) and "click" in ast.unparse(node):
                found.append(f"{name}:{node.lineno} {ast.unparse(node)}")
    assert not found, "\n".join(found)
