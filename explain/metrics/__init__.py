"""How faithful a map is: the field's evaluation metrics, batched on the input's device.

Each model-based metric takes the model, the images ``x`` (N, C, H, W), one map per image (N, h, w) at any
resolution (``result.cams``) and the target the maps explain (``result.target``, or a class, or None for the
top class), and returns per-image values; every perturbed copy of every image goes through the model in chunks
of ``batch_size``, and the model is left as it was.

Files: ``scoring.py`` (binding the target and scoring perturbed copies), ``perturbation.py`` (deletion,
insertion, ROAD), ``imputation.py`` (RISE's blur, ROAD's noisy linear imputer), ``confidence.py`` (Average
Drop, Increase in Confidence, Average Gain), ``pointing.py`` (the pointing games), ``localisation.py`` (relevance
mass and rank accuracy, top-k intersection, attribution localisation, AUC), ``complexity.py`` (sparseness,
complexity, effective complexity), ``faithfulness.py`` (pixel flipping, region perturbation, selectivity,
monotonicity, faithfulness estimate and correlation), ``infidelity.py`` (infidelity, sensitivity-n),
``robustness.py`` (max- and avg-sensitivity, the local Lipschitz estimate), ``axiomatic.py`` (completeness,
non-sensitivity), ``irof.py`` (IROF), ``consistency.py`` (sufficiency, consistency), ``stability.py`` (relative
input, output and representation stability, continuity), ``focus.py`` (Focus, mosaics), ``randomisation.py``
(MPRT, sMPRT, eMPRT, random logit), ``invariance.py`` (input invariance), ``similarity.py`` (Pearson, Spearman,
SSIM), ``sanity.py`` (cascading randomization).

>>> result = explain.GradCAM(model)(x)
>>> explain.metrics.deletion(model, x, result.cams, result.target).auc   # (N,), lower is better
"""

from .axiomatic import completeness, non_sensitivity
from .complexity import complexity, effective_complexity, sparseness
from .confidence import ConfidenceChange, average_drop, average_gain, increase_in_confidence
from .consistency import consistency, sufficiency
from .faithfulness import (
    RegionResult,
    faithfulness_correlation,
    faithfulness_estimate,
    monotonicity,
    monotonicity_correlation,
    pixel_flipping,
    region_perturbation,
    selectivity,
)
from .focus import Mosaics, focus, mosaics
from .imputation import gaussian_blur, noisy_linear_imputation
from .infidelity import infidelity, patch_removals, sensitivity_n
from .invariance import input_invariance, shifted_model
from .irof import IrofResult, irof, superpixels
from .localisation import (
    attribution_localisation,
    localisation_auc,
    relevance_mass_accuracy,
    relevance_rank_accuracy,
    top_k_intersection,
)
from .perturbation import CurveResult, RoadResult, deletion, insertion, road
from .pointing import energy_pointing_game, pointing_game
from .randomisation import emprt, histogram_entropy, mprt, random_logit, resettable_modules, smprt
from .robustness import avg_sensitivity, local_lipschitz_estimate, max_sensitivity, sensitivity
from .sanity import SanityResult, cascading_blocks, sanity_check
from .stability import (
    continuity,
    relative_input_stability,
    relative_output_stability,
    relative_representation_stability,
    relative_stability,
    translations,
)

__all__ = [
    "ConfidenceChange",
    "CurveResult",
    "IrofResult",
    "Mosaics",
    "RegionResult",
    "RoadResult",
    "SanityResult",
    "attribution_localisation",
    "average_drop",
    "average_gain",
    "avg_sensitivity",
    "cascading_blocks",
    "completeness",
    "complexity",
    "consistency",
    "continuity",
    "deletion",
    "effective_complexity",
    "emprt",
    "energy_pointing_game",
    "faithfulness_correlation",
    "faithfulness_estimate",
    "focus",
    "gaussian_blur",
    "histogram_entropy",
    "increase_in_confidence",
    "infidelity",
    "input_invariance",
    "insertion",
    "irof",
    "local_lipschitz_estimate",
    "localisation_auc",
    "max_sensitivity",
    "monotonicity",
    "monotonicity_correlation",
    "mosaics",
    "mprt",
    "noisy_linear_imputation",
    "non_sensitivity",
    "patch_removals",
    "pixel_flipping",
    "pointing_game",
    "random_logit",
    "region_perturbation",
    "relative_input_stability",
    "relative_output_stability",
    "relative_representation_stability",
    "relative_stability",
    "relevance_mass_accuracy",
    "relevance_rank_accuracy",
    "resettable_modules",
    "road",
    "sanity_check",
    "selectivity",
    "sensitivity",
    "sensitivity_n",
    "shifted_model",
    "smprt",
    "sparseness",
    "sufficiency",
    "superpixels",
    "top_k_intersection",
    "translations",
]
