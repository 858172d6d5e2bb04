"""A layer whose output is complex or integer is ``wrong-dtype`` in every family.

Such an output is never compared (casting it to the reference's dtype would drop its imaginary part
or its fraction, and pass), never called ``output-detached`` (an integer tensor has no graph) and
never back-propagated: the shared observation names its dtype (:mod:`tpsim.props.observation`); the
module family, whose dense reference is the module itself, names it there too. Each layer's twin
computes the same complex value and returns its real part: it passes (a whole module's twin returns
its real output directly: the module family's magnitude run bounds no complex arithmetic).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tpsim import builtin_variants
from tpsim.props.family import family_of
from tpsim.props.search import search


def _complex(t: torch.Tensor) -> torch.Tensor:
    return t + 1000j * t


def _integer(t: torch.Tensor) -> torch.Tensor:
    return t.round().to(torch.int64)


def _twin(t: torch.Tensor) -> torch.Tensor:
    return _complex(t).real  # exactly t: the same complex computation, its real part returned


def _real(t: torch.Tensor) -> torch.Tensor:
    return t


def _returning(variant: Any, convert: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``variant`` with ``convert`` applied to what its forward (its loss function) returns."""
    if hasattr(variant, "fn"):  # a cross-entropy: the function is the layer
        fn = variant.fn

        @functools.wraps(fn)  # the same signature: the keywords it accepts are read from it
        def loss(*args: Any, **kwargs: Any) -> torch.Tensor:
            return convert(fn(*args, **kwargs))

        return variant.replace(fn=loss, name=f"{variant.name}->{convert.__name__}")
    call = variant.call
    return variant.replace(forward=lambda module, x: convert(call(module, x)), name=f"{variant.name}->{convert.__name__}")


VARIANTS = [builtin_variants.column, builtin_variants.row, builtin_variants.mlp_gelu, builtin_variants.vocab_embedding,
            builtin_variants.vocab_cross_entropy, builtin_variants.attention]


@pytest.mark.parametrize("convert", [_complex, _integer], ids=["complex", "integer"])
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: family_of(v).name + ":" + v.name)
def test_a_complex_or_integer_output_is_wrong_dtype(variant: Any, convert: Callable[[torch.Tensor], torch.Tensor]) -> None:
    report = search(_returning(variant, convert), max_examples=15, seed=0, dtypes=("float64", "float32"),
                    world_sizes=(1, 2))
    assert [(f.property, f.diagnosis) for f in report.failures] == [("forward-equivalence", "wrong-dtype")], [
        f.describe() for f in report.failures]
    failure = report.failures[0]
    expected = "complex" if convert is _complex else "int64"
    assert expected in failure.details["dtype"] and failure.details["expected_dtype"] == failure.case.dtype
    assert "must be a real floating tensor" in failure.message


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: family_of(v).name + ":" + v.name)
def test_the_real_twin_passes(variant: Any) -> None:
    twin = _real if family_of(variant).name == "module" else _twin
    report = search(_returning(variant, twin), max_examples=15, seed=0, dtypes=("float64", "float32"),
                    world_sizes=(1, 2))
    assert report.passed, [f.describe() for f in report.failures]


def test_complex_arithmetic_inside_a_whole_module_is_judged_by_the_dense_twin() -> None:
    # No magnitude rule covers complex values: the dense twin sets the tolerance (no refusal).
    from tpsim.props.module.case import ModuleCase
    from tpsim.props.module.family import MODULE

    for dtype in ("float64", "float32"):
        assert MODULE.check_case(_returning(builtin_variants.mlp_gelu, _twin),
                                 ModuleCase(world_size=2, sizes=(2, 4), batch_shape=(2,), dtype=dtype, seed=0)) == []
