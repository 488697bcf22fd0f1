"""Concepts: what the model sees, not only where.

- CRAFT (:mod:`explain.concepts.craft`): concepts found by factorizing a layer's activations over crops
  (:mod:`explain.concepts.factorization`), ranked for a target by Sobol total indices (:mod:`explain.concepts.sobol`),
  and mapped on any image;
- CRP (:mod:`explain.concepts.crp`): the relevance of a target through each of K concepts at a layer, in one pass,
  and each concept's reference samples over a data set (:mod:`explain.concepts.references`);
- TCAV (:mod:`explain.concepts.tcav`): whether a class's score rises along a user's concept, and how significantly;
- dictionaries (:mod:`explain.concepts.dictionaries`): a concept basis learned elsewhere, mapped like CRAFT's.

Every layer is read and rewritten through the engine's own pass (:mod:`explain.concepts.reading`), so any model and
target explain explains has concepts too.
"""

from .craft import ConceptBank, Craft, Importance, crop_boxes, cut
from .crp import ConceptMaps, ConceptRelevance
from .dictionaries import dictionary_bank
from .factorization import Factors, coefficients, factorize
from .references import References
from .sobol import TotalIndices, jansen_total, sobol_design
from .tcav import TCAV, TCAVResult, cav, t_test

__all__ = [
    "TCAV", "ConceptBank", "ConceptMaps", "ConceptRelevance", "Craft", "Factors", "Importance", "References",
    "TCAVResult",
    "TotalIndices", "cav", "coefficients", "crop_boxes", "cut", "dictionary_bank", "factorize", "jansen_total",
    "sobol_design", "t_test",
]  # fmt: skip
