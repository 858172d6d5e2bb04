"""A variant derived after its target was resolved (``variant.replace(...)``: a diagnosis confirmed by
re-running the case with a changed declaration) reaches every backend exactly: the worker processes
that resolve its target again (the isolated inproc worker, gloo ranks) apply the same changes, so a
confirmation cannot test one variant isolated and another in process. And the re-run that confirms a
mechanism must pass a second, larger case too (:func:`corroborating_case`).

Rank functions are module-level so gloo workers can import them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tpsim import InvalidArgument
from tpsim.placement import Shard
from tpsim.props.launch import launch, target_ref, variant_of
from tpsim.props.module.case import ModuleCase
from tpsim.props.module.checks import corroborating_case
from tpsim.target import resolve_target
from tpsim.variant import ParamSpec

PICOTRON = str(Path(__file__).resolve().parent / "wild" / "picotron_block.py")
RUNS = [pytest.param("inproc", False, id="in-process"), pytest.param("inproc", True, id="isolated"),
        pytest.param("gloo", False, marks=pytest.mark.gloo, id="gloo")]


def _declared() -> Any:
    (variant,) = [v for v in resolve_target(PICOTRON, kind="module") if v.name == "kv_repeat_tiled"]
    return variant


def rank_sees(payload: dict[str, Any]) -> tuple[bool, list[str], list[str]]:
    """What the rank's variant declares: forward-only, its declared parameters and their placements."""
    variant = variant_of(payload)
    return variant.forward_only, [s.name for s in variant.params], [str(s.placement) for s in variant.params]


def test_a_resolved_variant_carries_no_change_and_a_derived_one_its_fields() -> None:
    declared = _declared()
    assert target_ref(declared, "gloo", False)[3] == ()
    packed = ParamSpec("attention.out_proj.weight", "weight", Shard(1, parts=(1, 1)))
    derived = declared.replace(params=(packed,)).replace(forward_only=True)
    assert target_ref(derived, "gloo", False) == (declared.target, "kv_repeat_tiled", declared.options,
                                                  (("params", (packed,)), ("forward_only", True)))
    assert target_ref(declared, "gloo", False)[3] == ()  # the declared one is still itself


@pytest.mark.parametrize(("backend", "isolate"), RUNS)
def test_every_backend_runs_exactly_the_derived_variant(backend: str, isolate: bool) -> None:
    declared = _declared()
    assert launch(rank_sees, declared, {}, 2, backend=backend, isolate=isolate) == [(False, [], [])] * 2
    derived = declared.replace(params=(ParamSpec("attention.out_proj.weight", "weight", Shard(1, parts=(1, 1))),),
                               forward_only=True)
    expected = (True, ["attention.out_proj.weight"], [str(Shard(1, parts=(1, 1)))])
    assert launch(rank_sees, derived, {}, 2, backend=backend, isolate=isolate) == [expected] * 2
    # and the declared variant again: a worker's cache tells the two apart
    assert launch(rank_sees, declared, {}, 2, backend=backend, isolate=isolate) == [(False, [], [])] * 2


def test_a_change_no_worker_can_receive_is_refused_by_name() -> None:
    derived = _declared().replace(build=lambda *sizes, group, dtype: None)
    with pytest.raises(InvalidArgument, match=r"variant 'kv_repeat_tiled' was derived with replace\(build=\.\.\.\), "
                                              r"a value the isolated inproc worker process cannot receive"):
        target_ref(derived, "inproc", True)


def test_the_corroborating_case_has_more_tokens_and_another_seed() -> None:
    case = ModuleCase(world_size=4, tp_size=2, sizes=(2, 2, 2), batch_shape=(1, 1), seed=0)
    other = corroborating_case(case)
    assert other == case.replace(batch_shape=(3, 3), seed=1)
    assert corroborating_case(case.replace(batch_shape=())) == case.replace(batch_shape=(), seed=1)
    # A case too large to grow is no corroboration (nothing is claimed from it).
    assert corroborating_case(case.replace(sizes=(2**13, 2, 2), batch_shape=(2**15 - 1,))) is None
