"""The diagnosis recognisers (tpsim/diagnosis.py) on synthetic tensors: each names its pattern and
stays silent on rounding noise, and every name the harness can report is documented."""

from __future__ import annotations

import torch

import tpsim.diagnosis as diagnosis
from tpsim.diagnosis import (
    DIAGNOSES,
    Diagnosis,
    Failure,
    bias_multiple,
    block_mapping,
    mismatch,
    rank_summands,
    regathered_dim,
    scale_factor,
)

F64 = torch.float64
TOL = torch.full((3, 4), 1e-9, dtype=F64)


def _y() -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(0), dtype=F64)


def test_every_reported_name_is_documented_in_the_module_docstring() -> None:
    required = {"bias-duplication", "bias-missing", "wrong-shard-dim", "wrong-shard-order", "missing-reduction",
                "grad-not-reduced", "grad-scaled", "bias-grad-rank0-only", "divisibility-unchecked", "shape-error",
                "exception", "mismatch"}
    assert required <= set(DIAGNOSES)
    for name in DIAGNOSES:
        assert f"``{name}``" in diagnosis.__doc__, name


def test_unknown_diagnosis_names_are_refused() -> None:
    try:
        Diagnosis("oops", "x")
    except ValueError as err:
        assert "Diagnosis(name='oops')" in str(err)
    else:  # pragma: no cover
        raise AssertionError("accepted an unknown name")


def test_bias_multiple() -> None:
    bias = torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=F64)
    diff = torch.stack([bias * 2] * 3)
    assert abs(bias_multiple(diff, bias, TOL) - 2.0) < 1e-12
    assert bias_multiple(diff + 1e-3, bias, TOL) is None
    assert bias_multiple(torch.zeros(3, 4, dtype=F64), bias, TOL) is None


def test_scale_factor_needs_evidence() -> None:
    y = _y()
    assert abs(scale_factor(y / 4, y, TOL) - 0.25) < 1e-12
    assert scale_factor(y + 1e-12, y, TOL) is None  # ~1: not a scale bug
    one = torch.tensor([2.0], dtype=F64)
    tiny = torch.tensor([1e-9], dtype=F64)
    assert scale_factor(one * 0.3, one, tiny) is None  # one number is a multiple of any other
    assert scale_factor(one * 0.5, one, tiny, known=(2, 0.5)) == 0.5


def test_block_mapping_finds_permuted_shards() -> None:
    y = _y()
    swapped = torch.cat([y[:, 2:], y[:, :2]], dim=-1)
    assert block_mapping(swapped, y, TOL, dim=-1, parts=2) == [1, 0]
    assert block_mapping(y, y, TOL, dim=-1, parts=2) == [0, 1]
    assert block_mapping(swapped + 1, y, TOL, dim=-1, parts=2) is None


def test_regathered_dim_recognises_a_gather_along_the_wrong_dim() -> None:
    y = _y()
    wrong = torch.cat(y.chunk(2, dim=-1), dim=0)  # [6, 2]
    assert regathered_dim(wrong, y, dim=-1, parts=2, tol_scalar=1e-9) == 0
    assert regathered_dim(wrong + 1, y, dim=-1, parts=2, tol_scalar=1e-9) is None


def test_rank_summands_tells_summands_from_a_scaled_result() -> None:
    y = _y()
    a = torch.randn(3, 4, generator=torch.Generator().manual_seed(1), dtype=F64)
    assert rank_summands([a, y - a], y, TOL)
    assert not rank_summands([y / 2, y / 2], y, TOL)  # identical halves: grad-scaled, not summands
    assert not rank_summands([y, y], y, TOL)


def test_mismatch_reports_max_errors_and_where() -> None:
    y = _y()
    bad = y.clone()
    bad[2, 1] += 5.0
    d = mismatch(bad, y, what="the output")
    assert d.name == "mismatch"
    assert d.details["where"] == [2, 1] and abs(d.details["max_abs"] - 5.0) < 1e-9
    assert "max abs error 5 at index [2, 1]" in d.message and "max rel error" in d.message


def test_failure_json_and_description() -> None:
    f = Failure("forward-equivalence", "mismatch", "off", details={"x": float("nan"), "t": (1, 2)})
    data = f.to_json()
    assert data["details"] == {"x": "nan", "t": [1, 2]}
    assert set(data) >= {"property", "diagnosis", "message", "case", "rank", "traceback", "case_file", "found_after"}
    assert f.describe().startswith("forward-equivalence: mismatch\n  off")
