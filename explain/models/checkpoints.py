"""Reading a user's checkpoint: a state_dict from a file, its class count from its shapes, loaded strictly into
the architecture; the bundled model's original tensor names mapped to timm's."""

from __future__ import annotations

import pickle
import re
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import Tensor, nn

from ..errors import ModelLoadError, first_line
from ..warning_filters import warning_filter

STATE_DICT_EXPECTED = "expected a state_dict: a file written by torch.save(model.state_dict(), path), or .safetensors"


def _unloadable(err: Exception) -> str:
    """Why a weights file could not be loaded, in the file's terms: never torch's advice to load it unsafely."""
    text = str(err)
    if isinstance(err, pickle.UnpicklingError):
        # weights_only refuses Python objects, naming the first: the class of a whole pickled model
        found = re.search(r"GLOBAL ([\w.]+)", text)
        if found:
            return f"holds a pickled {found[1]} object; {STATE_DICT_EXPECTED}"
        reason = re.search(r"WeightsUnpickler error:\s*(.+?)(?:\n|$)", text)
        detail = f" ({reason[1].strip()})" if reason else ""
        return f"cannot load weights: not a file that loads without running its code{detail}; {STATE_DICT_EXPECTED}"
    if isinstance(err, EOFError):
        return f"cannot load weights: the file is empty or cut short; {STATE_DICT_EXPECTED}"
    if isinstance(err, PermissionError):
        return f"cannot read ({err.strerror})"
    detail = re.sub(r"^\[enforce fail at [^]]*\]\s*\.?\s*", "", first_line(err))  # torch's C++ source location
    return f"cannot load weights: {detail}"


def read_state_dict(path: str | Path) -> dict[str, Tensor]:
    """Load a state_dict from ``.safetensors`` or a torch file (``weights_only=True``).

    A checkpoint that wraps its state_dict under ``"state_dict"`` or ``"model"`` is
    unwrapped, and a ``"module."`` prefix (DataParallel) is stripped.

    Raises:
        ModelLoadError: The file cannot be read, or holds something else than a
            state_dict (a pickled whole model, a training checkpoint without one);
            the message says what was found.
    """
    path = Path(path)
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path))
        else:
            with warning_filter("ignore", message="Detected pickle protocol"):  # torch's advice, not the user's
                state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # every loader failure is a problem of the file
        raise ModelLoadError(f"{path}: {_unloadable(err)}") from None
    for key in ("state_dict", "model"):
        if isinstance(state, Mapping) and isinstance(state.get(key), Mapping):
            state = state[key]
    if not isinstance(state, Mapping):
        raise ModelLoadError(f"{path}: holds a {type(state).__name__}; {STATE_DICT_EXPECTED}")
    others = [str(k) for k, v in state.items() if not isinstance(v, Tensor)]
    if others:
        shown = ", ".join(others[:5]) + (", ..." if len(others) > 5 else "")
        raise ModelLoadError(f"{path}: holds a dict whose entries {shown} are not tensors; {STATE_DICT_EXPECTED}")
    return {k.removeprefix("module."): v for k, v in state.items()}


def class_count(build: Callable[..., nn.Module], state: Mapping[str, Tensor], path: Path, name: str) -> int:
    """The class count a checkpoint was trained with, from the tensors whose shapes depend on it.

    The architecture is built (on the meta device: no memory, no initialization cost) for
    one and for two classes; the tensors that differ grow linearly with the class count
    (a classifier's rows, a detector's per-anchor class scores or per-class box deltas),
    so the checkpoint's first such tensor gives it.
    """
    with torch.device("meta"):
        one, two = build(num_classes=1).state_dict(), build(num_classes=2).state_dict()
    growing = [key for key in one if one[key].shape != two[key].shape]
    present = [key for key in growing if key in state]
    if not present:
        raise ModelLoadError(f"{path}: no classifier weights ({growing[0]}) in the checkpoint for {name}")
    key = present[0]
    base, step = one[key].shape[0], two[key].shape[0] - one[key].shape[0]
    count, rest = divmod(state[key].shape[0] - base, step)
    if rest or count < 0:
        raise ModelLoadError(f"{path}: {key} has shape {tuple(state[key].shape)}, which fits no class count of {name}")
    return count + 1


def fit_checkpoint(
    build: Callable[..., nn.Module], state: Mapping[str, Tensor], path: Path, name: str
) -> tuple[nn.Module, int]:
    """Build the architecture with the checkpoint's class count (see :func:`class_count`) and load the
    checkpoint; loading is strict, so every name and every shape is checked. Returns the model and its
    class count."""
    count = class_count(build, state, path, name)
    model = build(num_classes=count)
    load_strictly(model, state, path, name)
    return model, count


def load_strictly(model: nn.Module, state: Mapping[str, Tensor], path: Path, name: str) -> None:
    """Load a checkpoint into the model, every name and every shape checked.

    Raises:
        ModelLoadError: The checkpoint does not fit; the message names the file and the model.
    """
    try:
        model.load_state_dict(state)
    except RuntimeError as err:
        detail = " ".join(str(err).split())
        raise ModelLoadError(f"{path}: does not fit {name}: {detail[:300]}") from None


# EfficientNet-Lite0's original PyTorch port names its tensors differently from timm (and explain's own model).
_LITE0_STAGE_DEPTHS = (1, 2, 2, 3, 3, 4, 1)
_LITE0_TOP = {"_conv_stem": "conv_stem", "_bn0": "bn1", "_conv_head": "conv_head", "_bn1": "bn2", "_fc": "classifier"}
_LITE0_EXPANDING_BLOCK = {
    "_expand_conv": "conv_pw",
    "_bn0": "bn1",
    "_depthwise_conv": "conv_dw",
    "_bn1": "bn2",
    "_project_conv": "conv_pwl",
    "_bn2": "bn3",
}
_LITE0_DEPTHWISE_BLOCK = {"_depthwise_conv": "conv_dw", "_bn1": "bn1", "_project_conv": "conv_pw", "_bn2": "bn2"}


def lite0_state_to_timm(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Rename an EfficientNet-Lite0 state_dict from the original port's layout to timm's.

    ``_blocks.N.<part>`` becomes ``blocks.<stage>.<index>.<part>`` following the
    network's stage depths; the first stage's blocks have no expansion conv and
    name their parts differently. Shapes are checked when the result is loaded.

    Raises:
        ModelLoadError: A tensor name has no counterpart in timm's layout.
    """
    block_at = [(s, i) for s, depth in enumerate(_LITE0_STAGE_DEPTHS) for i in range(depth)]
    renamed: dict[str, Tensor] = {}
    for key, tensor in state.items():
        head, _, rest = key.partition(".")
        try:
            if head == "_blocks":
                number, part, leaf = rest.split(".", 2)
                stage, index = block_at[int(number)]
                expanding = f"_blocks.{number}._expand_conv.weight" in state
                part = (_LITE0_EXPANDING_BLOCK if expanding else _LITE0_DEPTHWISE_BLOCK)[part]
                renamed[f"blocks.{stage}.{index}.{part}.{leaf}"] = tensor
            else:
                renamed[f"{_LITE0_TOP[head]}.{rest}"] = tensor
        except (KeyError, IndexError, ValueError):
            raise ModelLoadError(f"EfficientNet-Lite0 tensor {key!r} has no counterpart in timm's layout") from None
    return renamed
