"""Context managers that leave a user's model exactly as they found it.

A CAM call switches parameter gradients off (so autograd records nothing before
the target layer and computes no weight gradient), may briefly switch the model
to eval mode (automatic layer search) and, in train mode, runs a forward pass
that updates BatchNorm statistics. Each change is undone here, on success and on
exception alike.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


@contextmanager
def frozen_parameters(model: nn.Module) -> Iterator[None]:
    """Switch ``requires_grad`` off on every parameter, restoring each flag on exit."""
    params = list(model.parameters())
    flags = [p.requires_grad for p in params]
    try:
        for p in params:
            p.requires_grad_(False)
        yield
    finally:
        for p, flag in zip(params, flags):
            p.requires_grad_(flag)


@contextmanager
def training_flags_kept(model: nn.Module) -> Iterator[None]:
    """Restore every submodule's ``training`` flag on exit."""
    flags = [(m, m.training) for m in model.modules()]
    try:
        yield
    finally:
        for m, flag in flags:
            if m.training != flag:
                m.training = flag


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """Put the model in eval mode for the block, then restore every module's flag."""
    with training_flags_kept(model):
        model.eval()
        yield


@contextmanager
def buffers_kept(model: nn.Module) -> Iterator[None]:
    """Restore buffers (e.g. BatchNorm running statistics) that a train-mode forward changes.

    Buffers are only copied when some module is in training mode: in eval mode the
    layers of torch.nn leave their buffers alone.
    """
    if not any(m.training for m in model.modules()):
        yield
        return
    saved = [(b, b.clone()) for b in model.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, copy in saved:
                b.copy_(copy)


@contextmanager
def untouched(model: nn.Module) -> Iterator[None]:
    """Everything a CAM call must leave as it was: parameter flags, training flags, buffers."""
    with frozen_parameters(model), training_flags_kept(model), buffers_kept(model):
        yield
