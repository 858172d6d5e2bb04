"""Training equivalence trains as people train: micro-batches accumulated by plain ``backward()`` calls
(grad hooks firing as in training), ``torch.optim.SGD`` after the last one, ``zero_grad`` in the case's
mode, the target's clip where it has one; and the ``torch.no_grad()`` inference path of a module.

What is checked here, through the public paths (``tpsim check``, ``tpsim replay``, the families'
``check_case``, ``search``):

- the case fields ``micro_batches`` (at least 2 in every drawn case, shrinking toward 2) and
  ``set_to_none`` (both drawn), replayable, and old case files without them reading as
  ``micro_batches=2, set_to_none=True``;
- a replicated grad all-reduced in a post-accumulate-grad hook is
  ``training-equivalence: grad-reduced-after-accumulation`` with its factor (tp-1), while the same
  block reducing only the fresh grad (a tensor hook) or in backward passes, on inproc and gloo
  (tests/wild/head_norm_hooks.py);
- a distributed clip that counts replicated parameters once per rank is
  ``training-equivalence: norm-counts-replicas``; the clip that counts them once passes, on inproc and
  gloo (tests/wild/clip_styles.py);
- a grad buffer that only ``zero_grad(set_to_none=False)`` clears is caught in the other mode;
- a module whose forward under ``torch.no_grad()`` skips its reduction fails forward equivalence,
  the message naming the no_grad path;
- the recognisers name their pattern only on its evidence (synthetic tensors).
"""

from __future__ import annotations

import json
import math
import pathlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import find, given, settings
from torch import nn

from tests.helpers import run_cli
from tpsim.diagnosis import GRAD_REDUCED_AFTER_ACCUMULATION, NORM_COUNTS_REPLICAS
from tpsim.errors import InvalidArgument
from tpsim.module_variant import ModuleVariant
from tpsim.mutants import CATALOG, master_weight_variant
from tpsim.mutants.row import CorrectRow
from tpsim.placement import Replicate
from tpsim.props import check_case
from tpsim.props.case import load_case, save_case
from tpsim.props.family import family_of
from tpsim.props.linear.case import Case
from tpsim.props.linear.strategies import cases
from tpsim.props.linear.world import make_masters
from tpsim.props.module.case import ModuleCase
from tpsim.props.module.strategies import module_cases
from tpsim.props.placed import Placed
from tpsim.props.rank import MICRO_BATCHES, schedule, total_micro_batches
from tpsim.props.search import search
from tpsim.props.training import norm_counts_replicas, reduced_after_accumulation
from tpsim.target import resolve_target

ROOT = pathlib.Path(__file__).resolve().parent.parent
HOOKS = "tests/wild/head_norm_hooks.py"
CLIPS = "tests/wild/clip_styles.py"
SMALL = ["--max-examples", "20", "--world-sizes", "1,2", "--seed", "0"]
F64 = torch.float64


def _check(capsys: Any, tmp_path: pathlib.Path, monkeypatch: Any, target: str, *more: str) -> tuple[int, str]:
    monkeypatch.chdir(ROOT)
    code, out, _ = run_cli(capsys, "check", target, *SMALL, "--cases-dir", str(tmp_path), *more)
    return code, out


# --- the case fields ---------------------------------------------------------------------------------


def test_the_training_fields_default_and_replay() -> None:
    case = Case(world_size=2, in_features=4, out_features=2)
    assert (case.micro_batches, case.set_to_none) == (MICRO_BATCHES, True) == (2, True)
    assert schedule(case) == (2, 1) and total_micro_batches(case) == 3
    # At their defaults the fields are not written: earlier files keep their contents and names.
    assert "micro_batches" not in case.to_dict() and "set_to_none" not in case.to_dict()
    other = case.replace(micro_batches=3, set_to_none=False)
    assert other.to_dict()["micro_batches"] == 3 and other.to_dict()["set_to_none"] is False
    assert Case.from_dict(other.to_dict()) == other and other.key() != case.key()
    assert "micro_batches=3" in other.describe() and "set_to_none=False" in other.describe()
    module = ModuleCase(world_size=2, sizes=(2, 2), micro_batches=3)
    assert ModuleCase.from_dict(module.to_dict()) == module and schedule(module) == (3, 1)


def test_two_micro_batches_draw_what_three_single_steps_drew() -> None:
    # A case file written when every step had one micro-batch replays on the same three draws.
    m = make_masters(Case(world_size=2, in_features=3, out_features=2, batch_shape=(2,), seed=5))
    assert len(m.inputs) == len(m.grads) == 3
    three = make_masters(Case(world_size=2, in_features=3, out_features=2, batch_shape=(2,), seed=5, micro_batches=3))
    assert len(three.inputs) == 4 and all(torch.equal(a, b) for a, b in zip(m.inputs, three.inputs[:3], strict=True))


def test_an_old_case_file_reads_with_the_defaults(tmp_path: pathlib.Path) -> None:
    old = {"format": "tpsim-case", "schema_version": 2, "family": "module",
           "case": {"world_size": 2, "sizes": [2, 2], "batch_shape": [2], "seed": 1}, "found": {}}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    case, _ = load_case(str(path))
    assert (case.micro_batches, case.set_to_none) == (2, True)


@pytest.mark.parametrize(("changes", "message"), [
    ({"micro_batches": 0}, "micro_batches=0 must be an int >= 1"),
    ({"micro_batches": 17}, "micro_batches=17 must be an int <= 16"),
    ({"micro_batches": "2"}, "micro_batches='2' must be an int >= 1"),
    ({"set_to_none": "yes"}, "set_to_none='yes' must be a bool (optimizer.zero_grad's mode)"),
])
def test_bad_training_fields_are_refused_by_name(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        Case.from_dict({"world_size": 2, "in_features": 2, "out_features": 2, **changes})
    assert str(err.value) == message


def _drawn(strategy: Any) -> list[Any]:
    drawn: list[Any] = []

    @settings(max_examples=60, database=None, derandomize=True)
    @given(strategy)
    def collect(case: Any) -> None:
        drawn.append(case)

    collect()
    return drawn


def test_every_drawn_case_accumulates_and_both_zero_grad_modes_are_drawn() -> None:
    (variant,) = resolve_target("tpsim.layers:RowParallelLinear")
    (module,) = [v for v in resolve_target("tpsim.layers") if v.name == "ParallelMLP(gelu)"]
    seen = set()
    for strategy in (cases(variant, world_sizes=(1, 2, 3)), module_cases(module, world_sizes=(1, 2, 3),
                                                                         dtypes=("float64",))):
        drawn = _drawn(strategy)
        assert drawn and all(c.micro_batches >= 2 for c in drawn)
        seen |= {c.set_to_none for c in drawn}
        # Shrinking goes toward two micro-batches and torch's default zero_grad.
        smallest = find(strategy, lambda c: True, settings=settings(database=None))
        assert (smallest.micro_batches, smallest.set_to_none) == (2, True)
    assert seen == {True, False}


# --- grads reduced after accumulation ----------------------------------------------------------------


def test_a_post_accumulate_grad_hook_that_reduces_is_named_with_its_factor(capsys, tmp_path, monkeypatch) -> None:
    code, out = _check(capsys, tmp_path, monkeypatch, f"{HOOKS}:head_norm_post_accumulate")
    # Named with the sublayer that owns the parameter.
    assert code == 1 and "FAILED training-equivalence: norm: grad-reduced-after-accumulation" in out, out
    assert "the norm.weight grad accumulated over 2 micro-batches" in out
    assert "plus (tp-1) = 1 times the first micro-batch's grad" in out
    doc = json.loads(next(tmp_path.glob("*training_equivalence*.json")).read_text())
    assert doc["found"]["diagnosis"] == GRAD_REDUCED_AFTER_ACCUMULATION


def test_the_factor_is_measured_on_the_case() -> None:
    (variant,) = resolve_target(f"{ROOT / HOOKS}:head_norm_post_accumulate")
    case = ModuleCase(world_size=3, sizes=(3, 3), batch_shape=(2,), seed=4)
    # The first micro-batch's grads are right: only training (accumulation) shows it.
    (f,) = family_of(variant).check_case(variant, case)
    assert f.diagnosis == GRAD_REDUCED_AFTER_ACCUMULATION and f.consequences == []
    assert f.property == "training-equivalence" and abs(f.details["factor"] - 2.0) < 1e-6
    assert f.details["param"] == "norm.weight" and "(tp-1) = 2" in f.message


@pytest.mark.parametrize("tp", [2, 3])
def test_over_three_micro_batches_each_earlier_one_is_counted_with_its_power_of_tp(tp: int) -> None:
    (variant,) = resolve_target(f"{ROOT / HOOKS}:head_norm_post_accumulate")
    case = ModuleCase(world_size=tp, sizes=(6, 6), batch_shape=(2,), seed=4, micro_batches=3)
    (f,) = family_of(variant).check_case(variant, case)
    # all_reduce after each backward: tp^2 S1 + tp S2 + S3, the dense S1 + S2 + S3 plus (tp^2-1) S1 + (tp-1) S2.
    assert f.diagnosis == GRAD_REDUCED_AFTER_ACCUMULATION, f.describe()
    assert f.details["factors"] == pytest.approx([tp * tp - 1, tp - 1], rel=1e-6)
    assert f"(tp^2-1) = {tp * tp - 1} times the first micro-batch's grad and (tp-1) = {tp - 1} times the second's" \
        in f.message


def test_a_linear_grad_reduced_after_three_micro_batches_is_named() -> None:
    (mutant,) = [m for m in CATALOG if m.name == "sequence-bias-grad-hook-reduce"]
    found = search(mutant.variant, max_examples=30, seed=0, shrink=False, world_sizes=(2,))
    assert any(f.diagnosis == GRAD_REDUCED_AFTER_ACCUMULATION for f in found.failures), found.failures
    case = next(f.case for f in found.failures if f.diagnosis == GRAD_REDUCED_AFTER_ACCUMULATION)
    failures = check_case(mutant.variant, case.replace(micro_batches=3))
    assert GRAD_REDUCED_AFTER_ACCUMULATION in {f.diagnosis for f in failures}, [f.describe() for f in failures]


@pytest.mark.parametrize("name", ["head_norm_tensor_hook", "head_norm_backward"])
@pytest.mark.parametrize("backend", ["inproc", "gloo"])  # gloo: the thorough tier
def test_reducing_the_fresh_grad_passes(capsys, tmp_path, monkeypatch, name: str, backend: str) -> None:
    more = ("--backend", "gloo", "--max-examples", "8") if backend == "gloo" else ()
    code, out = _check(capsys, tmp_path, monkeypatch, f"{HOOKS}:{name}", *more)
    assert code == 0, out


class _MainGradRow(CorrectRow):
    """A row layer keeping its bias grad in a persistent ``main_grad`` buffer that ``param.grad`` aliases
    (grad-accumulation fusion's style): ``zero_grad(set_to_none=False)`` zeroes the buffer through the
    alias, ``set_to_none=True`` drops the alias and leaves the buffer holding the last step's grads."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.bias is not None:
            self.bias.register_post_accumulate_grad_hook(self._into_main_grad)

    @staticmethod
    def _into_main_grad(p: Any) -> None:
        if getattr(p, "main_grad", None) is None:
            p.main_grad = torch.zeros_like(p)
        if p.grad is not p.main_grad:  # a fresh grad: move it into the buffer
            p.main_grad.add_(p.grad)
            p.grad = p.main_grad


main_grad_row = master_weight_variant(_MainGradRow, "row", name="main_grad_row")


def test_a_grad_buffer_only_zeroed_in_place_is_caught_when_grads_are_dropped() -> None:
    case = Case(world_size=2, in_features=4, out_features=3, batch_shape=(2,), bias=True, seed=2)
    assert check_case(main_grad_row, case.replace(set_to_none=False)) == []
    failures = check_case(main_grad_row, case)
    assert [f.property for f in failures] == ["training-equivalence"] and "bias after training" in failures[0].message
    report = search(main_grad_row, world_sizes=(1, 2), max_examples=40, seed=0)
    assert not report.passed and all(f.case.set_to_none is True for f in report.failures)


# --- clipping by global norm -------------------------------------------------------------------------


def test_a_clip_that_counts_replicas_is_named(capsys, tmp_path, monkeypatch) -> None:
    code, out = _check(capsys, tmp_path, monkeypatch, f"{CLIPS}:pre_norm_mlp_clip_counts_replicas")
    assert code == 1 and "FAILED training-equivalence: norm-counts-replicas" in out, out
    assert "(tp-1) * sum of the replicated grads^2" in out
    assert "norm.weight" in out and "fc2.bias" in out


def test_the_norm_is_confirmed_numerically() -> None:
    (variant,) = resolve_target(f"{ROOT / CLIPS}:pre_norm_mlp_clip_counts_replicas")
    failures = family_of(variant).check_case(variant, ModuleCase(world_size=3, sizes=(3, 3), batch_shape=(2,), seed=1))
    (f,) = [f for f in failures if f.diagnosis == NORM_COUNTS_REPLICAS]
    d = f.details
    assert d["tp"] == 3 and abs(d["norm"] - d["counted_norm"]) < 1e-9 * d["norm"] and d["norm"] > d["dense_norm"]
    assert sorted(d["replicated"]) == ["fc2.bias", "norm.bias", "norm.weight"]


@pytest.mark.parametrize("backend", ["inproc", pytest.param("gloo", marks=pytest.mark.smoke)])
def test_the_clip_that_counts_each_parameter_once_passes(capsys, tmp_path, monkeypatch, backend: str) -> None:
    more = ("--backend", "gloo", "--max-examples", "8") if backend == "gloo" else ()
    code, out = _check(capsys, tmp_path, monkeypatch, f"{CLIPS}:pre_norm_mlp_clipped", *more)
    assert code == 0, out


def test_clipping_happens_and_a_clip_without_a_norm_is_a_usage_error() -> None:
    (variant,) = resolve_target(f"{ROOT / CLIPS}:pre_norm_mlp_clipped")
    case = ModuleCase(world_size=2, sizes=(2, 4), batch_shape=(3,), seed=0)
    obs = family_of(variant).observe(variant, case)
    ref = obs.data.groups[0].value
    assert ref.max_norm is not None and ref.norms[0] > ref.max_norm  # the first step is clipped
    assert all(abs(v.norms[0] - ref.norms[0]) < 1e-9 * ref.norms[0] for v in obs.values)

    def no_norm(parameters: Any, max_norm: float) -> None:
        return None

    with pytest.raises(InvalidArgument, match="returned a NoneType on rank 0; clip.parameters, max_norm. must return"):
        family_of(variant).check_case(variant.replace(clip=no_norm), case)
    with pytest.raises(InvalidArgument, match="clip=3; expected None or a callable"):
        variant.replace(clip=3)


# --- the no_grad inference path ----------------------------------------------------------------------


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class InferenceFastPathRow(nn.Module):
    """A row layer (input sharded, weight ``[out, in/tp]``) whose forward under ``torch.no_grad()`` takes a
    "local kernel" fast path that forgets the all-reduce."""

    def __init__(self, hidden: int, *, group: Any, dtype: Any) -> None:
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(torch.empty(hidden, hidden // dist.get_world_size(group), dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nn.functional.linear(x, self.weight)
        return y if not torch.is_grad_enabled() else _Reduce.apply(y, self.group)


fast_path_row = ModuleVariant(name="fast_path_row", sizes=("hidden",), input="sharded",
                              build=lambda hidden, *, group, dtype: InferenceFastPathRow(hidden, group=group, dtype=dtype))


def test_the_no_grad_path_is_compared_with_dense() -> None:
    case = ModuleCase(world_size=2, sizes=(4,), batch_shape=(2,), seed=0)
    failures = family_of(fast_path_row).check_case(fast_path_row, case)
    assert failures and failures[0].property == "forward-equivalence", failures
    assert "the output under torch.no_grad()" in failures[0].message and "inference path" in failures[0].message
    # Its training forward is right: every other property holds.
    assert all(f.property == "forward-equivalence" for f in failures)
    assert family_of(fast_path_row).check_case(fast_path_row, case.replace(world_size=1, tp_size=1)) == []


# --- the recognisers on synthetic tensors -----------------------------------------------------------


def _placed(actual: torch.Tensor, full: torch.Tensor) -> Placed:
    return Placed("the w grad accumulated", [actual, actual], full, torch.full_like(full, 1e-9), Replicate(),
                  grad=True, param="w")


def test_earlier_micro_batches_counted_again_are_each_named_with_their_factor() -> None:
    gen = torch.Generator().manual_seed(1)
    s1, s2, s3 = (torch.randn(3, 4, generator=gen, dtype=F64) for _ in range(3))
    full, got = s1 + s2 + s3, 4 * s1 + 2 * s2 + s3  # tp = 2: all_reduce after each of three backwards
    tol = torch.full_like(full, 1e-9)
    found = reduced_after_accumulation([s1, s2], tol, 2, 3)(_placed(got, full), got, [got] * 2)
    assert found is not None and found.details["factors"] == pytest.approx([3, 1])
    # Every micro-batch scaled alike is a combination too, but no name: the last is needed apart.
    assert reduced_after_accumulation([s1, s2], tol, 2, 3)(_placed(2 * full, full), 2 * full, []) is None
    # Given only the first of three micro-batches' grads, nothing is fitted (no false name from a partial model).
    assert reduced_after_accumulation(s1, tol, 2, 3)(_placed(got, full), got, [got] * 2) is None


def test_an_earlier_micro_batch_counted_again_is_named_with_its_factor() -> None:
    gen = torch.Generator().manual_seed(0)
    first, second = (torch.randn(3, 4, generator=gen, dtype=F64) for _ in range(2))
    full = first + second
    tol = torch.full_like(full, 1e-9)
    recognise = reduced_after_accumulation(first, tol, 4, 2)
    found = recognise(_placed(full + 3 * first, full), full + 3 * first, [full + 3 * first] * 2)
    assert found is not None and found.name == GRAD_REDUCED_AFTER_ACCUMULATION and "(tp-1) = 3" in found.message
    assert abs(found.details["factor"] - 3) < 1e-9
    # Every micro-batch scaled alike, rounding noise, a first micro-batch proportional to the rest: no name.
    assert recognise(_placed(2 * full, full), 2 * full, []) is None
    # Replicas that differ (each its own summand) are no reduction after accumulation, whatever one holds.
    assert recognise(_placed(full + 3 * first, full), full + 3 * first, [full + 3 * first, full - 3 * first]) is None
    assert recognise(_placed(full + 1e-12, full), full + 1e-12, []) is None
    assert reduced_after_accumulation(first, tol, 4, 2)(_placed(3 * first, 2 * first), 3 * first, []) is None
    assert reduced_after_accumulation(first, tol, 4, 1)(_placed(full + 3 * first, full), full + 3 * first, []) is None


def test_a_norm_counting_replicas_is_named_only_on_its_evidence() -> None:
    dense, replicated_sq, tp = 2.0, 0.5, 3
    counted = math.sqrt(dense**2 + (tp - 1) * replicated_sq)
    found = norm_counts_replicas(counted, dense, replicated_sq, tp, 1e-9, ["b"])
    assert found is not None and found.name == NORM_COUNTS_REPLICAS and found.details["counted_norm"] == counted
    assert norm_counts_replicas(counted * 1.01, dense, replicated_sq, tp, 1e-9, ["b"]) is None
    assert norm_counts_replicas(dense, dense, replicated_sq, tp, 1e-9, ["b"]) is None
    assert norm_counts_replicas(counted, dense, replicated_sq, 1, 1e-9, ["b"]) is None


def test_a_case_with_more_micro_batches_replays(capsys, tmp_path: pathlib.Path) -> None:
    case = Case(world_size=2, in_features=4, out_features=2, batch_shape=(3,), bias=True, seed=7, micro_batches=3,
                set_to_none=False, target="tpsim.layers", variant="RowParallelLinear")
    path = save_case(case, str(tmp_path))
    assert json.loads(pathlib.Path(path).read_text())["case"]["micro_batches"] == 3
    code, out, _ = run_cli(capsys, "replay", path)
    assert code == 0 and "micro_batches=3" in out and "set_to_none=False" in out, out
