"""Pretrained weights from the local caches first.

A model named by ``--model`` whose pretrained weights are cached loads from the cache without a network call: the
Hugging Face Hub's cache for timm's weights (``timm/NAME``), torch's hub directory for torchvision's. Where they
are not cached, the machine is asked once, within :data:`PROBE_SECONDS`, whether it reaches the weights' host; an
offline machine (or one whose Hub client is set offline, ``HF_HUB_OFFLINE=1``) gets one line at once naming the
way out, instead of the download clients' retries.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlparse

from ..errors import ModelLoadError
from .names import BUNDLED_MODEL

PROBE_SECONDS = 3.0  # the longest wait for the weights' host to answer
HUB_HOST = "huggingface.co"
HUB_FILES = ("model.safetensors", "pytorch_model.bin")  # what timm reads from a model's Hub repository, in order
_OFFLINE_VALUES = ("1", "true", "yes", "on")


def hub_offline() -> bool:
    """Whether the user set the Hugging Face Hub's client offline (``HF_HUB_OFFLINE``)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _OFFLINE_VALUES


def reachable(host: str) -> bool:
    """Whether ``host`` accepts a connection on port 443 within :data:`PROBE_SECONDS`, its name's lookup included
    (run on a thread, so that a lookup that hangs is not waited for)."""
    answered: list[bool] = []

    def connect() -> None:
        try:
            socket.create_connection((host, 443), timeout=PROBE_SECONDS).close()
            answered.append(True)
        except OSError:
            pass

    thread = threading.Thread(target=connect, daemon=True, name="explain-probe")
    thread.start()
    thread.join(PROBE_SECONDS)
    return bool(answered)


def hub_cached(repo: str, filenames: Sequence[str] = HUB_FILES) -> Path | None:
    """The first of ``filenames`` in the local Hub cache's copy of ``repo`` (its main revision), or None."""
    from huggingface_hub import constants, try_to_load_from_cache

    for filename in filenames:
        found = try_to_load_from_cache(repo, filename, cache_dir=constants.HF_HUB_CACHE)
        if isinstance(found, str):
            return Path(found)
    return None


def torch_cached(url: str) -> Path | None:
    """The file torch's hub keeps for a weights URL (``hub.get_dir()/checkpoints/<file name>``), or None."""
    import torch

    path = Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(urlparse(url).path)
    return path if path.is_file() else None


def timm_cached(architecture: str) -> tuple[Path | None, str, str]:
    """A timm model's pretrained weights in the local caches: the file (None where not cached), where they come
    from (a Hub repository or a URL) and that place's host.

    Raises:
        ModelLoadError: timm has no pretrained weights of that name.
    """
    import timm

    config = timm.models.get_pretrained_cfg(architecture)
    if config is None or not (config.hf_hub_id or config.url):
        raise ModelLoadError(f"timm/{architecture}: timm has no pretrained weights of that name; give --weights FILE")
    if config.hf_hub_id:
        files = (config.hf_hub_filename,) if config.hf_hub_filename else HUB_FILES
        found = hub_cached(config.hf_hub_id, files)
        if found is None and config.url:
            found = torch_cached(config.url)
        return found, f"{config.hf_hub_id} on the Hugging Face Hub", HUB_HOST
    return torch_cached(config.url), config.url, urlparse(config.url).hostname or ""


def check_online(name: str, source: str, host: str, hub: bool = False) -> None:
    """Refuse at once to fetch weights that are not cached where ``host`` cannot be reached.

    Raises:
        ModelLoadError: Offline: one line naming the weights and the ways out.
    """
    if (hub and hub_offline()) or not reachable(host):
        raise ModelLoadError(
            f"{name}: its pretrained weights ({source}) are not in the local cache, and {host} cannot be reached "
            f"(offline): fetch them once where there is network, into the same cache, or give --weights FILE, or use "
            f"--model {BUNDLED_MODEL} (bundled, offline)"
        )
