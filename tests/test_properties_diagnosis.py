"""The diagnosis recognisers on synthetic tensors and on small cases: each names its pattern only on
its evidence and stays silent on rounding noise; a failure quotes an element that violates its bound."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

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
from tpsim.mutants import CATALOG, master_weight_variant
from tpsim.mutants.column import CorrectColumn
from tpsim.props import check_case
from tpsim.props.linear.case import Case

F64 = torch.float64
TOL = torch.full((3, 4), 1e-9, dtype=F64)


def _y() -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(0), dtype=F64)


def test_every_name_the_checks_report_is_registered() -> None:
    required = {"bias-duplication", "bias-missing", "wrong-shard-dim", "wrong-shard-order", "missing-reduction",
                "grad-not-reduced", "grad-scaled", "bias-grad-rank0-only", "divisibility-unchecked", "shape-error",
                "wrong-dtype", "output-detached", "exception", "mismatch"}
    assert required <= set(DIAGNOSES)


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


# --- diagnoses identify, they don't guess ---------------------------------------------------------

MUTANTS = {m.name: m for m in CATALOG}


def test_mismatch_quotes_the_worst_violation_not_the_largest_error() -> None:
    expected = torch.tensor([100.0, 1e-6], dtype=F64)
    actual = torch.tensor([100.01, 2e-6], dtype=F64)  # 0.01 within its bound; 1e-6 far outside its own
    tol = torch.tensor([0.1, 1e-8], dtype=F64)
    d = mismatch(actual, expected, what="the output", tol=tol)
    assert d.details["where"] == [1] and d.details["where_max_abs"] == [0]
    assert "at index [1] got 2e-06, expected 1e-06" in d.message and "bound 1e-08" in d.message


class _ColumnBiasSlightlyOff(CorrectColumn):
    """Adds 0.95 * bias: off by 5% of the bias, within bfloat16 rounding of a float64 result."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(self.enter(x), self.weight)
        return y + 0.95 * self.bias if self.bias is not None else y


def test_a_small_structural_error_in_float64_is_no_precision_loss() -> None:
    # The error is a few hundredths on values of order one: within bfloat16's rounding, but
    # recomputing the layer in bfloat16 does not explain it, so it is no precision loss.
    variant = master_weight_variant(_ColumnBiasSlightlyOff, "column", name="bias_slightly_off")
    case = Case(world_size=2, in_features=4, out_features=4, batch_shape=(3,), dtype="float64", bias=True, seed=5)
    failure = check_case(variant, case)[0]
    assert (failure.property, failure.diagnosis) == ("forward-equivalence", "mismatch")
    assert "the error is -0.05*bias" in failure.message
    assert "not a precision loss" in failure.message


def test_precision_loss_is_named_on_the_evidence_of_a_recomputation() -> None:
    case = Case(world_size=2, in_features=4, out_features=3, batch_shape=(3,), dtype="float64", bias=True, seed=1)
    (failure,) = check_case(MUTANTS["row-half-precision-reduce"].variant, case)
    assert (failure.property, failure.diagnosis) == ("forward-equivalence", "precision-loss")
    assert failure.details["emulation"] == "the ranks' summands reduced in float16"
    assert failure.details["emulated_residual"] <= 0.25 * failure.details["residual"]
    # The backward went through the same cast: its grads are consequences of the same cause.
    assert {c.property for c in failure.consequences} >= {"input-grad-equivalence", "weight-grad-equivalence"}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64"])
def test_an_output_in_another_dtype_is_wrong_dtype(dtype: str) -> None:
    case = Case(world_size=2, in_features=2, out_features=3, batch_shape=(2,), dtype=dtype, bias=True, seed=0)
    (failure,) = check_case(MUTANTS["row-reduce-float32"].variant, case)
    assert (failure.property, failure.diagnosis) == ("forward-equivalence", "wrong-dtype")
    assert f"is float32, but the case is {dtype}" in failure.message
    assert check_case(MUTANTS["row-reduce-float32"].variant, case.replace(dtype="float32")) == []


def test_an_output_without_autograd_is_output_detached() -> None:
    case = Case(world_size=2, in_features=2, out_features=4, batch_shape=(3,), bias=True, seed=0)
    (failure,) = check_case(MUTANTS["column-gather-no-autograd"].variant, case)
    assert (failure.property, failure.diagnosis) == ("forward-equivalence", "output-detached")
    assert "grad_fn is None" in failure.message and failure.rank == 0


def test_a_double_reduction_is_recognised_with_a_bias_too() -> None:
    case = Case(world_size=3, in_features=3, out_features=2, batch_shape=(2,), bias=True, seed=0)
    (failure,) = check_case(MUTANTS["row-reduce-twice"].variant, case)
    assert (failure.property, failure.diagnosis) == ("forward-equivalence", "double-reduction")
    assert "3 x the dense output" in failure.message


def test_a_weight_used_through_data_is_grad_missing() -> None:
    case = Case(world_size=2, in_features=2, out_features=2, batch_shape=(2,), bias=False, seed=0)
    (failure,) = check_case(MUTANTS["row-weight-data"].variant, case)
    assert (failure.property, failure.diagnosis) == ("weight-grad-equivalence", "grad-missing")
    # Training compares the grads accumulated over the first step first: the same grad is missing there.
    assert [(c.property, c.diagnosis) for c in failure.consequences] == [("training-equivalence", "grad-missing")]
