"""tpsim's property suite: Hypothesis strategies, cases, the properties checked on them, and the search.

- :mod:`properties.case` — :class:`Case` and its versioned JSON case file;
- :mod:`properties.strategies` — Hypothesis strategies generating cases for a variant;
- :mod:`properties.tolerance` — the documented tolerance formula;
- :mod:`properties.world` — one world run per case and the float64 dense reference;
- :mod:`properties.checks` — the properties, one named function each, and :func:`check_case`;
- :mod:`properties.search` — :func:`search`: generate, check, shrink, diagnose (what ``tpsim check`` runs);
- :mod:`properties.suite` — :func:`property_tests`: the suite as pytest tests in one line;
- :mod:`properties.mlp` — forward/gradient equivalence of a parallel MLP (lab-note scale).
"""

from properties.case import SCHEMA_VERSION, Case, CaseFileError, load_case, save_case
from properties.checks import (
    PROPERTIES,
    PropertyFailed,
    bias_grad_equivalence,
    check_case,
    divisibility,
    forward_equivalence,
    input_grad_equivalence,
    replica_consistency,
    training_equivalence,
    weight_grad_equivalence,
)
from properties.search import SearchReport, search
from properties.strategies import cases
from properties.suite import property_tests

__all__ = [
    "PROPERTIES",
    "SCHEMA_VERSION",
    "Case",
    "CaseFileError",
    "PropertyFailed",
    "SearchReport",
    "bias_grad_equivalence",
    "cases",
    "check_case",
    "divisibility",
    "forward_equivalence",
    "input_grad_equivalence",
    "load_case",
    "property_tests",
    "replica_consistency",
    "save_case",
    "search",
    "training_equivalence",
    "weight_grad_equivalence",
]
