"""Placements (tpsim/placement.py): shard_tensor and assemble are inverse, refuse sizes that do not
divide with the numbers in the message, and packed parts shard part by part."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tpsim.errors import InvalidArgument
from tpsim.placement import Partial, Replicate, Shard, assemble, shard_shape, shard_tensor


def test_short_names_and_predicates() -> None:
    assert (str(Shard(0)), str(Replicate()), str(Partial())) == ("S(0)", "R", "P")
    assert str(Shard(0, parts=(4, 2))) == "S(0,parts=[4, 2])"
    assert Shard(1).is_shard() and Shard(1).is_shard(1) and not Shard(1).is_shard(0)
    assert Replicate().is_replicate() and Partial().is_partial() and not Replicate().is_shard()
    assert Shard(0, parts=[2, 2]) == Shard(0, parts=(2, 2))  # lists normalised: hashable, comparable
    hash(Shard(0, parts=[2, 2]))


@settings(max_examples=50, deadline=None, database=None)
@given(ws=st.integers(1, 6), rows=st.integers(1, 4), cols=st.integers(1, 4), dim=st.sampled_from([0, 1, -1]))
def test_shard_and_assemble_are_inverse(ws: int, rows: int, cols: int, dim: int) -> None:
    full = torch.arange(rows * ws * cols * ws, dtype=torch.float64).reshape(rows * ws, cols * ws)
    pieces = [shard_tensor(full, Shard(dim), r, ws) for r in range(ws)]
    assert all(p.shape == shard_shape(full.shape, Shard(dim), ws) for p in pieces)
    assert torch.equal(assemble(pieces, Shard(dim)), full)
    assert torch.equal(assemble([shard_tensor(full, Partial(), r, ws) for r in range(ws)], Partial()), full)
    assert torch.equal(assemble([shard_tensor(full, Replicate(), r, ws) for r in range(ws)], Replicate()), full)


def test_packed_parts_shard_each_part_on_its_own() -> None:
    # gate [0..3] and up [4..7] over 2 ranks: rank 0 holds gate[0:2] + up[0:2].
    full = torch.arange(8.0)
    placement = Shard(0, parts=(4, 4))
    assert shard_tensor(full, placement, 0, 2).tolist() == [0, 1, 4, 5]
    assert shard_tensor(full, placement, 1, 2).tolist() == [2, 3, 6, 7]
    assert torch.equal(assemble([shard_tensor(full, placement, r, 2) for r in range(2)], placement), full)
    # Unequal parts (grouped-query QKV: q=4, k=2, v=2).
    qkv = Shard(0, parts=(4, 2, 2))
    assert shard_tensor(full, qkv, 1, 2).tolist() == [2, 3, 5, 7]
    assert torch.equal(assemble([shard_tensor(full, qkv, r, 2) for r in range(2)], qkv), full)


def test_sizes_that_do_not_divide_are_refused_with_the_numbers() -> None:
    with pytest.raises(InvalidArgument, match=r"cannot shard a tensor of shape \[5, 2\] along dim 0: size 5 is not "
                                              r"divisible by world_size=2"):
        shard_tensor(torch.zeros(5, 2), Shard(0), 0, 2)
    with pytest.raises(InvalidArgument, match=r"part 1 \(size 3\) is not divisible by world_size=2"):
        shard_tensor(torch.zeros(7), Shard(0, parts=(4, 3)), 0, 2)
    with pytest.raises(InvalidArgument, match="the parts add up to 6 but the sharded dim has size 7"):
        shard_tensor(torch.zeros(7), Shard(0, parts=(4, 2)), 0, 2)
    with pytest.raises(InvalidArgument, match=r"rank=2 must be an int in \[0, 2\)"):
        shard_tensor(torch.zeros(4), Shard(0), 2, 2)
    with pytest.raises(InvalidArgument, match="dim must be an int"):
        Shard("0")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="pieces is empty"):
        assemble([], Shard(0))


def test_chunk_pieces_follow_torch_chunk_with_empty_pieces_after_the_last() -> None:
    from tpsim.placement import split_sizes, uneven_pieces

    assert split_sizes(5, 4, "chunk") == (2, 2, 1, 0)
    assert split_sizes(7, 3, "chunk") == (3, 3, 1)
    assert split_sizes(5, 4) == (2, 1, 1, 1)
    for size, ws in [(5, 4), (7, 3), (9, 4), (2, 4), (8, 4)]:
        t = torch.arange(size)
        with uneven_pieces("chunk"):
            pieces = [shard_tensor(t, Shard(0), r, ws) for r in range(ws)]
        chunks = list(torch.chunk(t, ws))
        assert [p.tolist() for p in pieces] == [c.tolist() for c in chunks] + [[]] * (ws - len(chunks))
        assert torch.equal(assemble(pieces, Shard(0)), t)
    with pytest.raises(InvalidArgument, match=r"uneven_pieces\(style='ceil'\): expected one of tensor_split, chunk"):
        with uneven_pieces("ceil"):
            pass
