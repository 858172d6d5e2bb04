"""The project's property tests: Hypothesis suites over tpsim's own layer core.

``tox`` runs this directory beside ``tests/``. Each suite states a claim about the layers in
``tpsim.layers`` and lets Hypothesis search for a counterexample; a failure is shrunk to its
minimal case, saved under ``.tpsim/cases/`` and ends with the ``tpsim replay`` line that
reproduces it. The number of examples follows the Hypothesis profile (``dev``, ``ci``,
``thorough``: see ``conftest.py``).
"""

from __future__ import annotations

from hypothesis import settings

from tpsim.props.suite import property_tests

_EXAMPLES = max(25, settings().max_examples)

#: One test per property, parametrised by every variant ``tpsim.layers`` declares (column, row,
#: gathered, replicated-input row, packed gate/up and QKV, sequence-parallel column and row).
TestLayerCore = property_tests("tpsim.layers", max_examples=_EXAMPLES, seed=5)
