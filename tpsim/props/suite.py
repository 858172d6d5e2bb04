"""Run tpsim's property suite on your own variant from your own pytest tests, in one line.

Put this in a test module (e.g. ``tests/test_my_layer.py``)::

    from tpsim.props.suite import property_tests

    TestMyColumn = property_tests("mypkg.layers:MyColumnVariant", max_examples=200)

pytest then collects one test per property its variants' families check — for a linear layer
``TestMyColumn::test_forward_equivalence``, ``::test_input_grad_equivalence``,
``::test_weight_grad_equivalence``, ``::test_bias_grad_equivalence``, ``::test_replica_consistency``,
``::test_training_equivalence``, ``::test_divisibility`` — each parametrised by the variants it
applies to when the target names several (a bare module: ``property_tests("mypkg.layers")`` checks
every variant it declares, as ``tpsim check mypkg.layers`` does). A property a variant is not
checked for (an embedding has no input grad, a cross-entropy of logits no weights) gets no test
for it (:meth:`tpsim.props.family.Family.applicable`): every generated test can fail.

The first of these tests runs one :func:`tpsim.props.search.search` per variant (cached for the
rest of the session, so the properties share the generated cases); each test then fails with its
property's minimal case and diagnosis, or passes. ``variant_or_target`` is a
:class:`~tpsim.variant.Variant` or :class:`~tpsim.module_variant.ModuleVariant`, a list of them, or a
``tpsim check`` TARGET string (a bare module: its linear layers and its modules); the keyword
arguments are :func:`~tpsim.props.search.search`'s (``world_sizes``, ``dtypes``, ``max_examples``,
``seed``, ``backend``, ``timeout``, ``database``), plus ``target_options`` (a dict of
``convention``/``kind``/``input``/``output``/``input_grad``, as the CLI flags) for plain classes.
Without ``backend`` the tests use the ``--tpsim-backend`` option of tpsim's pytest plugin (default
``inproc``); without ``seed`` the Hypothesis profile decides (derandomised in tpsim's ``ci``).
"""

from __future__ import annotations

import json
from typing import Any

from tpsim.errors import InvalidArgument
from tpsim.props.case import save_failure
from tpsim.props.family import family_of
from tpsim.props.linear.checks import PropertyFailed
from tpsim.props.search import SearchReport, search

__all__ = ["property_tests", "reproduction"]

_SEARCH_OPTIONS = ("world_sizes", "dtypes", "max_examples", "seed", "backend", "timeout", "database")


def _variants(variant_or_target: Any, target_options: dict[str, Any] | None) -> list[Any]:
    from tpsim.props.family import families
    from tpsim.target import resolve_target

    def is_variant(v: Any) -> bool:
        return any(isinstance(v, f.variant_type) for f in families())

    if is_variant(variant_or_target):
        return [variant_or_target]
    if isinstance(variant_or_target, (list, tuple)) and variant_or_target and all(
        is_variant(v) for v in variant_or_target
    ):
        return list(variant_or_target)
    if isinstance(variant_or_target, str):
        # Every family's variants: a bare module gives its linear layers and its modules.
        return resolve_target(variant_or_target, **(target_options or {}))
    raise InvalidArgument(
        f"variant_or_target={variant_or_target!r}: expected a tpsim Variant, a list of them, or a target string "
        "(any family's variants: a ModuleVariant too)"
    )


def reproduction(failure: Any) -> str:
    """The exact way to re-run ``failure``'s case, printed with every failure.

    ``tpsim replay PATH`` when the case file names an importable target; otherwise (a variant
    object built inside a test) a copy-pasteable Python snippet.
    """
    if getattr(failure, "case_file", None) and failure.case.target:
        return f"tpsim replay {failure.case_file}    (add --backend gloo to confirm on real process groups)"
    case = json.dumps(json.dumps(failure.case.to_dict(), sort_keys=True))
    family = getattr(failure.case, "family", "linear")
    if family == "linear":
        return (
            "import json; from tpsim.props.linear.case import Case; from tpsim.props.linear.family import check_case\n"
            f"check_case(VARIANT, Case.from_dict(json.loads({case})))  # VARIANT: your variant"
        )
    return (
        f"import json; from tpsim.props.family import family_named; family = family_named({family!r})\n"
        f"family.check_case(VARIANT, family.case_from_dict(json.loads({case})), backend='inproc', timeout=30.0)"
        "  # VARIANT: your variant"
    )


def property_tests(variant_or_target: Any, *, target_options: dict[str, Any] | None = None,
                   forward_only: bool = False, **search_options: Any) -> type:
    """A pytest test class with one test per property (see the module docstring). ``forward_only=True``:
    inference layers and modules (``tpsim check --forward-only``): the forward runs alone and only the
    forward-only properties get tests."""
    if not isinstance(forward_only, bool):
        raise InvalidArgument(f"property_tests(forward_only={forward_only!r}): expected a bool")
    unknown = sorted(set(search_options) - set(_SEARCH_OPTIONS))
    if unknown:
        raise InvalidArgument(f"unknown option(s) {unknown}; expected some of {list(_SEARCH_OPTIONS)}")
    import pytest  # only test modules call this; keep the import out of the harness's import path

    variants = _variants(variant_or_target, target_options)
    if not variants:
        raise InvalidArgument(f"{variant_or_target!r} names no variants")
    if forward_only:
        refused = [v.name for v in variants if not hasattr(v, "forward_only")]
        if refused:
            raise InvalidArgument(f"property_tests(forward_only=True): {refused} are neither linear layers nor "
                                  "modules; forward-only applies to linear layers (Variant(forward_only=True)) and "
                                  "modules (ModuleVariant(forward_only=True))")
        variants = [v if v.forward_only else v.replace(forward_only=True) for v in variants]
    reports: dict[tuple[str, str], SearchReport] = {}

    def report_for(variant: Any, backend: str) -> SearchReport:
        key = (variant.name, backend)
        if key not in reports:
            options = dict(search_options, backend=backend)
            reports[key] = search(variant, **options)
        return reports[key]

    def make_test(prop: str, checked: list[Any]) -> Any:
        @pytest.mark.parametrize("variant", checked, ids=[v.name for v in checked])
        def test(self: Any, variant: Any, request: Any) -> None:
            backend = search_options.get("backend") or request.config.getoption("--tpsim-backend", default="inproc")
            report = report_for(variant, backend)
            for failure in report.failures:
                if failure.property == prop:
                    if failure.case is not None and failure.case_file is None:
                        # Saved like `tpsim check` saves it, so `tpsim replay` takes it from here.
                        save_failure(failure, variant, backend=backend, command=f"pytest {request.node.nodeid}")
                    err = PropertyFailed(failure)
                    err.add_note(failure.describe())
                    err.add_note("Reproduce: " + reproduction(failure))
                    raise err

        test.__name__ = "test_" + prop.replace("-", "_")
        test.__doc__ = f"{prop} holds on every generated case."
        return test

    namespace: dict[str, Any] = {"__doc__": f"tpsim's property suite on {', '.join(v.name for v in variants)}."}
    # One test per property some variant's family checks (its registry) and that applies to it,
    # parametrised by those variants only: every generated test can fail.
    variants = [family_of(v).prepared(v) for v in variants]
    checks = {id(v): family_of(v).applicable(v) for v in variants}
    for prop in dict.fromkeys(p for v in variants for p in family_of(v).properties):
        checked = [v for v in variants if prop in checks[id(v)]]
        if checked:
            namespace["test_" + prop.replace("-", "_")] = make_test(prop, checked)
    name = "TestTpsimProperties"
    return type(name, (), namespace)
