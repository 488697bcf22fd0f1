"""``explain concepts`` and ``explain tcav``: the concept atlas of a folder of images, and a concept's TCAV score,
written to an output folder (see :mod:`explain.concepts` for what they compute)."""
