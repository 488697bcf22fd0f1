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

from ..lazy_names import lazy_names
from .craft import ConceptBank, Craft, Importance
from .crp import ConceptMaps, ConceptRelevance
from .dictionaries import dictionary_bank
from .references import References
from .tcav import TCAV, TCAVResult, cav

__all__ = [
    "TCAV", "ConceptBank", "ConceptMaps", "ConceptRelevance", "Craft", "Importance", "References", "TCAVResult", "cav",
    "dictionary_bank",
]  # fmt: skip

# The pieces the calls above are made of left this surface for their modules, kept one release.
__getattr__, _ = lazy_names(
    __name__,
    {},
    deprecated={
        name: (module, name, f"explain.concepts.{module}.{name}")
        for module, names in {
            "factorization": ("Factors", "coefficients", "factorize"),
            "sobol": ("TotalIndices", "jansen_total", "sobol_design"),
            "craft": ("crop_boxes", "cut"),
            "tcav": ("t_test",),
        }.items()
        for name in names
    },
)
