"""The engine and what it stands on: nothing here imports export, I/O or the command line.

``engine.py`` (the CAM base class: passes, smoothing, fusion), ``hooks.py`` (every hook explain registers, and
the recorder of activations and gradients), ``model_state.py`` (the user's model left as it was), ``maps.py``
(map arithmetic), ``layers.py`` (layer resolution and the automatic choice), ``layouts.py`` (how an output
becomes a map), ``rows.py`` (row-restricted backward), ``folding.py`` (batch norms folded for scoring
forwards), ``attention_capture.py`` (attention probabilities recorded), ``detectors.py`` (detector internals),
``result.py`` (what a call returns; it shows itself in Jupyter, drawing with :mod:`explain.io.render` when asked).
"""
