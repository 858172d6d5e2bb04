"""Property suites over whole modules: tpsim's MLPs with every activation they offer, and the
user-style MLP of ``examples/my_mlp.py``, each checked against itself on a one-rank tp group.

``properties/test_layer_core.py`` runs the MLPs ``tpsim.layers`` declares (GELU, SwiGLU, SwiGLU with
sequence parallelism); these add the rest of ``ParallelMLP``'s activations (ReLU's gradients are
compared in float64 cases, see :mod:`tpsim.props.module.magnitude`) and a module that is not
tpsim's. The number of examples follows the Hypothesis profile.
"""

from __future__ import annotations

import pathlib

from hypothesis import settings

from tpsim.builtin_variants import mlp_variant
from tpsim.props.suite import property_tests

_EXAMPLES = max(25, settings().max_examples)
_EXAMPLE_MLP = str(pathlib.Path(__file__).resolve().parent.parent / "examples" / "my_mlp.py") + ":TensorParallelMLP"

#: ParallelMLP with the activations tpsim.layers does not declare (no target: built here).
TestParallelMLPActivations = property_tests(
    [mlp_variant(a).replace(target=None) for a in ("silu", "geglu", "relu")], max_examples=_EXAMPLES, seed=7
)

#: A user's MLP written with plain torch.distributed, as ``tpsim check FILE:Class --kind module`` sees it.
TestUserMLP = property_tests(_EXAMPLE_MLP, target_options={"kind": "module"}, max_examples=_EXAMPLES, seed=7)
