"""Context managers that leave a user's model exactly as they found it.

A CAM call switches parameter gradients off (so autograd records nothing before
the target layer and computes no weight gradient), may briefly switch the model
to eval mode (automatic layer search) and, in train mode, runs a forward pass
that updates BatchNorm statistics. Each change is undone here, on success and on
exception alike.

Calls on one model from several threads run one after another: each holds the model's lock (:func:`exclusive`)
for its whole length, since the hooks, the frozen flags and the eval mode of one call would otherwise change what
another computes and restores. The lock is re-entrant, so a call made inside another on the same thread (Guided
Grad-CAM's Grad-CAM, a metric's forwards inside an export) goes through; but a call made while one of the
model's passes runs (from a hook on the model, or a target's score) is refused: its hooks and flags would mix
with those of the pass around it.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from ..errors import ExplainError

_LOCKS: weakref.WeakKeyDictionary[nn.Module, threading.RLock] = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()
_PASSES = threading.local()  # .models: the ids of the models whose pass this thread is running


@contextmanager
def running(model: nn.Module) -> Iterator[None]:
    """Mark the block as a pass of the model on this thread (its forward, backward and scoring)."""
    models = _PASSES.__dict__.setdefault("models", [])
    models.append(id(model))
    try:
        yield
    finally:
        models.pop()


@contextmanager
def exclusive(model: nn.Module) -> Iterator[None]:
    """For the block, this thread alone works on the model: other threads' calls on it wait (a re-entrant lock
    kept while the model lives).

    Raises:
        ExplainError: This thread is running a pass of the model: the call comes from a hook or a target.
    """
    if id(model) in _PASSES.__dict__.get("models", ()):
        raise ExplainError(
            "explain was called on a model from inside a pass of another explain call on it (a hook on the model, "
            "or a target's score): the two calls' hooks and flags would mix; call it after the first call returns"
        )
    with _LOCKS_GUARD:
        lock = _LOCKS.get(model)
        if lock is None:
            lock = _LOCKS[model] = threading.RLock()
    with lock:
        yield


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
    """Put the model in eval mode for the block, then restore every module's flag; other threads' calls on the
    model wait meanwhile."""
    with exclusive(model), training_flags_kept(model):
        model.eval()
        yield


@contextmanager
def buffers_kept(model: nn.Module) -> Iterator[None]:
    """Restore buffers (e.g. BatchNorm running statistics) that a train-mode forward changes.

    Only the buffers of modules in training mode are copied: in eval mode the layers of torch.nn leave their
    buffers alone.
    """
    saved = [(b, b.clone()) for m in model.modules() if m.training for b in m.buffers(recurse=False)]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, copy in saved:
                b.copy_(copy)


@contextmanager
def untouched(model: nn.Module) -> Iterator[None]:
    """Everything a CAM call must leave as it was: parameter flags, training flags, buffers; other threads' calls
    on the model wait meanwhile."""
    with exclusive(model), frozen_parameters(model), training_flags_kept(model), buffers_kept(model):
        yield
