"""Kinds of output, one :class:`explain.tasks.base.Task` each: what every front end asks of a model's output.

Modules: ``asked.py`` (what a user asks, torch-free: the options some kinds take, a dense model's prompt),
``base.py`` (the :class:`~explain.tasks.base.Task` protocol), ``images.py`` (classes, segments, boxes, oriented
boxes, keypoints, a depth region, a prompted mask), ``language.py`` (a vision-language model's words, prompts and
query boxes), ``answers.py`` (``explain_answer``, ``explain_prompts``, ``explain_queries``), ``registry.py``
(:func:`~explain.tasks.registry.task_of`: which task a model's output is). Import the module you need: this
package imports nothing, so that the command line reads ``asked.py`` without torch.
"""
