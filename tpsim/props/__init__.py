"""tpsim's property suite: Hypothesis strategies, cases, the properties checked on them, and the search.

- :mod:`tpsim.props.case` — :class:`Case` and its versioned JSON case file;
- :mod:`tpsim.props.strategies` — Hypothesis strategies generating cases for a variant;
- :mod:`tpsim.props.tolerance` — the documented tolerance formula;
- :mod:`tpsim.props.linear.world` — one world run per case and the float64 dense reference;
- :mod:`tpsim.props.linear.checks` — the properties of a linear layer and their recognisers; the public
  functions, one per property, and :func:`check_case` are the linear family's (:mod:`tpsim.props.linear`);
- :mod:`tpsim.props.search` — :func:`search`: generate, check, shrink, diagnose (what ``tpsim check`` runs);
- :mod:`tpsim.props.suite` — :func:`property_tests`: the suite as pytest tests in one line;
- :mod:`tpsim.props.family` — the :class:`~tpsim.props.family.Family` base class: the engine the
  search, the CLI, case files, fault plans and the pytest suite share, whose hooks each kind of
  target fills in: :mod:`tpsim.props.linear` (single linear layers), :mod:`tpsim.props.module`
  (whole modules: MLPs, blocks, norms), :mod:`tpsim.props.vocab` (embeddings, cross-entropies),
  :mod:`tpsim.props.attention` (head-sharded attention);
- :mod:`tpsim.props.observation`, :mod:`tpsim.props.rank`, :mod:`tpsim.props.blame` — one world run
  per case for every family: its observation, the rank side, and how a rank's error is named.
"""

from tpsim.props.case import SCHEMA_VERSION, CaseFileError, load_case, save_case
from tpsim.props.linear.case import Case
from tpsim.props.linear.checks import PROPERTIES, PropertyFailed
from tpsim.props.linear.family import (
    bias_grad_equivalence,
    check_case,
    divisibility,
    forward_equivalence,
    input_grad_equivalence,
    replica_consistency,
    training_equivalence,
    weight_grad_equivalence,
)
from tpsim.props.linear.strategies import cases
from tpsim.props.search import SearchReport, search
from tpsim.props.suite import property_tests

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
