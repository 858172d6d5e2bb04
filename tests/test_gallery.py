"""The gallery of published bugs (tpsim/mutants/gallery.py): each mutant is caught with its intended
diagnosis within the default example budget, its docstring cites the public report, the layout
mutants' messages say only non-contiguous layouts show them, and docs/bugs.md lists every mutant."""

from __future__ import annotations

import os

import pytest

from tpsim.mutants import CATALOG, gallery
from tpsim.props import check_case
from tpsim.props.linear.case import Case
from tpsim.props.search import search

CATCH_BUDGET = 200
GALLERY = {
    "row-wrong-group": "Megatron-LM #7452",
    "row-contiguous-copy-reduce": "Megatron-LM #5337",
    "column-backward-contiguous-copy": "SkyRL #1886",
    # no public report: the docstring quotes the error every rank raises
    "column-view-flatten": "view size is not compatible with input tensor's size and stride",
    "row-replica-init-diverges": "Automodel #1291",
}
BY_NAME = {m.name: m for m in CATALOG}
DOCS = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "bugs.md")


def test_the_gallery_is_catalogued_and_cites_its_reports() -> None:
    assert set(GALLERY) <= set(BY_NAME)
    assert all(GALLERY.values()), "an empty citation is in every docstring: the check would be vacuous"
    for name, report in GALLERY.items():
        m = BY_NAME[name]
        assert m.variant.target == f"tpsim.mutants:{m.variant.name}"
        assert report in _doc_of(m), name


def _doc_of(m) -> str:
    for cls in vars(gallery).values():
        if isinstance(cls, type) and cls.__doc__ and " ".join(cls.__doc__.split()).startswith(m.description[:60]):
            return " ".join(cls.__doc__.split())
    raise AssertionError(f"no gallery class documents {m.name}")


@pytest.mark.parametrize("name", list(GALLERY))
def test_each_gallery_mutant_is_caught_with_its_diagnosis(name) -> None:
    m = BY_NAME[name]
    report = search(m.variant, max_examples=CATCH_BUDGET, seed=0, database=None)
    hits = [f for f in report.failures if f.diagnosis == m.diagnosis]
    assert hits, (name, [(f.property, f.diagnosis) for f in report.failures])
    case = hits[0].case
    if name == "row-wrong-group":
        assert case.tp_size < case.world_size and "instead of over its own tp group" in hits[0].message
    if name in ("row-contiguous-copy-reduce", "column-backward-contiguous-copy", "column-view-flatten"):
        assert case.input_layout != "contiguous"
        assert "appears only for non-contiguous layouts" in hits[0].message
    if name == "row-replica-init-diverges":
        assert "right after construction" in hits[0].message


def test_docs_list_every_catalogued_mutant() -> None:
    text = open(DOCS, encoding="utf-8").read()
    missing = [m.name for m in CATALOG if f"`{m.name}`" not in text]
    assert not missing, missing


@pytest.mark.gloo
def test_gallery_on_gloo() -> None:
    cases = {
        "row-wrong-group": Case(world_size=4, tp_size=2, in_features=2, out_features=2),
        "row-contiguous-copy-reduce": Case(world_size=2, in_features=4, out_features=2, batch_shape=(2,),
                                           input_layout="transposed"),
        "column-backward-contiguous-copy": Case(world_size=2, in_features=2, out_features=4, batch_shape=(2,),
                                                input_layout="transposed"),
        "column-view-flatten": Case(world_size=2, in_features=2, out_features=2, batch_shape=(2, 2),
                                    input_layout="strided"),
        "row-replica-init-diverges": Case(world_size=2, in_features=2, out_features=2, bias=True),
    }
    for name, case in cases.items():
        m = BY_NAME[name]
        failures = check_case(m.variant, case, backend="gloo", timeout=30)
        assert m.diagnosis in [f.diagnosis for f in failures], (name, [f.diagnosis for f in failures])
