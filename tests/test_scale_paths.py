"""The large-tensor paths of the checks give the verdict of the plain comparison they stand for.

At a realistic size (the lab note's MLP, a 32000-id vocabulary) some comparisons take a shorter road
to the same answer: the embedding table's grad is compared without the dense ``[V, D]`` grad (rows of
ids in the range against their dense sums, every other row against the floor). These tests put the
short road and the plain comparison side by side on the same tensors, correct and perturbed.
"""

from __future__ import annotations

import pytest
import torch

from tpsim.props.placed import Placed, verdict
from tpsim.props.tolerance import tolerance
from tpsim.props.vocab.case import EmbeddingCase
from tpsim.props.vocab.checks import _grad_rows_hold, _rows_of, _table_grad
from tpsim.props.vocab.world import boundary_ids, embedding_data

F64 = torch.float64
CASE = EmbeddingCase(world_size=2, vocab_size=50, embedding_dim=6, batch_shape=(3, 4), dtype="float32", seed=3)


def _plain(got: torch.Tensor | None, where: tuple[int, int], ids: torch.Tensor, upstream: torch.Tensor) -> bool:
    """The plain comparison the family ran before the short road: the [V, D] grad, its rows, compare()."""
    expected, mag = _rows_of(CASE, _table_grad(CASE, ids, upstream), where)
    tol = tolerance(CASE.torch_dtype, mag, reduction_length=CASE.rows, world_size=2)
    return verdict(Placed("grad", [got], expected, tol, grad=True), CASE.torch_dtype) is None


def _correct(where: tuple[int, int], ids: torch.Tensor, upstream: torch.Tensor) -> torch.Tensor:
    expected, _ = _rows_of(CASE, _table_grad(CASE, ids, upstream), where)
    return expected.float()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    data = embedding_data(CASE)
    return data.ids[0], data.grads[0].to(F64)


def _untouched(where: tuple[int, int], ids: torch.Tensor) -> int:
    start, stop = where
    used = {int(i) for i in ids.reshape(-1)}
    return next(r for r in range(start, stop) if r not in used) - start


def _touched(where: tuple[int, int], ids: torch.Tensor) -> int:
    start, stop = where
    return next(int(i) for i in ids.reshape(-1) if start <= int(i) < stop) - start


PERTURBATIONS = {
    "correct": lambda t, u, h: t,
    "untouched row off by 1e-30": lambda t, u, h: t.index_put_((torch.tensor([u]),), torch.full((6,), 1e-30)),
    "untouched row NaN": lambda t, u, h: t.index_put_((torch.tensor([u]),), torch.full((6,), float("nan"))),
    "untouched row the smallest subnormal (under the floor)": lambda t, u, h: t.index_put_(
        (torch.tensor([u]),), torch.full((6,), torch.finfo(torch.float32).tiny * 2.0**-23)),
    "touched row off by 1e-3": lambda t, u, h: t.index_put_((torch.tensor([h]),), t[h] + 1e-3),
    "touched row rounded once more (within the bound)": lambda t, u, h: t.index_put_(
        (torch.tensor([h]),), torch.nextafter(t[h], torch.full_like(t[h], float("inf")))),
    "touched row infinite": lambda t, u, h: t.index_put_((torch.tensor([h]),), torch.full((6,), float("inf"))),
    "every row doubled": lambda t, u, h: t * 2,
    "wrong dtype": lambda t, u, h: t.double(),
    "one row short": lambda t, u, h: t[:-1],
}


@pytest.mark.parametrize("where", [(0, 25), (25, 50), (26, 52)], ids=["rank 0", "rank 1", "padded last rank"])
@pytest.mark.parametrize("name", list(PERTURBATIONS))
def test_embedding_grad_short_road_agrees_with_the_plain_comparison(where, name) -> None:
    ids, upstream = _data()
    got = PERTURBATIONS[name](_correct(where, ids, upstream).clone(), _untouched(where, ids), _touched(where, ids))
    plain = _plain(got, where, ids, upstream)
    assert _grad_rows_hold(CASE, ids, upstream, where, got, 2) is plain
    assert plain is (name in ("correct", "touched row rounded once more (within the bound)",
                              "untouched row the smallest subnormal (under the floor)"))


def test_embedding_grad_short_road_refuses_a_missing_grad() -> None:
    ids, upstream = _data()
    assert _grad_rows_hold(CASE, ids, upstream, (0, 25), None, 2) is False
    assert _plain(None, (0, 25), ids, upstream) is False


def test_the_cases_ids_reach_both_ends_of_every_range() -> None:
    # The short road's edge cases (a touched first or last row) are exercised by the drawn ids.
    ids, _ = _data()
    assert set(boundary_ids(CASE.vocab_size, 2)) <= {int(i) for i in ids.reshape(-1)}
