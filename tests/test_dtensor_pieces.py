"""Reading a DTensor's pieces through its placement (``tpsim.props.module.dtensor_pieces``).

- on real gloo worlds of 2 and 4 processes, every placement torch 2.13 has (``Shard``, ``Replicate``,
  ``Partial``, ``_StridedShard`` built as Hugging Face's ``packed_colwise`` / ``packed_rowwise`` build
  it), uneven sizes, on 1-D and 2-D meshes: ``assemble`` of the ranks' ``to_local()`` is the original
  tensor and ``full_tensor()``, and ``expected_piece`` is each rank's ``to_local()``, bit for bit (data
  movement only; a Partial's data are integers, exact in any summation order);
- without a world: torch's own split functions (``Shard`` / ``_StridedShard._split_tensor``, applied
  mesh dim by mesh dim as ``distribute_tensor`` applies them) agree with ``expected_piece`` on drawn
  layouts, ``assemble`` inverts it, and hand-made pieces (torch's docstring examples) read right;
- bad input and layouts tpsim does not read are refused by name.

Rank functions are module-level so gloo workers can unpickle them.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

import tpsim
from tpsim.errors import InvalidArgument
from tpsim.props.module.dtensor_pieces import (
    DTensorLayout,
    MeshPlacement,
    PieceShapeMismatch,
    UnsupportedLayout,
    assemble,
    diverging_replicas,
    expected_piece,
    piece_runs,
    piece_shape,
    placement_of,
)

# --- cases: (shape, mesh shape, placements as text) -------------------------------------------------
# "S0": Shard(0), "S-1": Shard(-1), "SS1/2": _StridedShard(1, split_factor=2), "R", "Psum"/"Pavg"/...

CASES_1D = [
    ((8, 6), ("S0",)), ((7, 5), ("S0",)), ((3, 5), ("S1",)), ((6, 5), ("S-1",)), ((1, 4), ("S0",)),
    ((5,), ("S0",)), ((6, 4), ("R",)),
    ((8, 3), ("SS0/2",)), ((10, 3), ("SS0/2",)), ((7, 3), ("SS0/2",)), ((3, 9), ("SS1/2",)), ((12, 2), ("SS0/3",)),
    ((2, 10, 3), ("SS1/2",)), ((2, 3, 10), ("SS-1/2",)), ((5, 3), ("SS0/2",)),
    ((4, 6), ("Psum",)), ((4, 6), ("Pmax",)), ((4, 6), ("Pmin",)), ((4, 6), ("Pavg",)),
]
CASES_2D = [
    ((8, 6), ("S0", "S1")), ((7, 5), ("S0", "S0")), ((8, 6), ("SS0/2", "S0")), ((10, 3), ("SS0/2", "S0")),
    ((6, 9), ("SS1/3", "S1")), ((8, 6), ("R", "S0")), ((7, 6), ("S0", "R")), ((8, 6), ("R", "SS0/2")),
    ((8, 6), ("Psum", "S1")), ((8, 6), ("S0", "Psum")), ((4, 6), ("Psum", "Psum")), ((4, 6), ("R", "R")),
    ((2, 10, 3), ("S0", "SS1/2")),
]
# torch 2.13's own full_tensor() misreads a (_StridedShard(d, k), Shard(d)) whose k is not the size of the
# later mesh dim (it cannot decode it into a shard order, and gathers as if it could): the pieces are the ones
# distribute_tensor cut, assemble() reads them back, full_tensor() does not. FSDP over TP makes k that size.
TORCH_GATHER_WRONG = [((6, 9), ("SS1/3", "S1"))]
# Partial data are integer multiples of 4: distribute_tensor's ``full / n`` and any summation order are exact.
INTEGER_DATA = ("Psum", "Pavg", "Pmax", "Pmin")


def _placement(text: str):
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if text == "R":
        return Replicate()
    if text.startswith("P"):
        return Partial(text[1:])
    if text.startswith("SS"):
        dim, sf = text[2:].split("/")
        return _StridedShard(int(dim), split_factor=int(sf))
    return Shard(int(text[1:]))


def _data(shape, placements, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if any(p in INTEGER_DATA for p in placements):
        return (torch.randint(-50, 50, shape, generator=g) * 4).float()
    return torch.randn(shape, generator=g)


def rank_distribute(cases, mesh_shape):
    """distribute_tensor each case's tensor; this rank's layout, piece, full_tensor() and original."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    names = ("dp", "tp")[-len(mesh_shape):]
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    out = []
    for i, (shape, placements) in enumerate(cases):
        full = _data(shape, placements, seed=i)
        try:
            dt, scattered = distribute_tensor(full, mesh, [_placement(p) for p in placements]), True
        except AssertionError:
            # torch 2.13 cannot scatter a _StridedShard whose pieces differ in size (it never pads them);
            # every rank cuts its own piece instead, as Hugging Face's styles do (src_data_rank=None)
            dt, scattered = distribute_tensor(full, mesh, [_placement(p) for p in placements], src_data_rank=None), False
        try:
            gathered = dt.full_tensor()
        except Exception as exc:  # noqa: BLE001 - gloo lacks some reductions (avg): the original is the check
            gathered = f"{type(exc).__name__}: {exc}"
        out.append({"layout": pickle.dumps(placement_of(dt)), "local": dt.to_local().clone(),
                    "full_tensor": gathered, "original": full, "scattered": scattered})
    return out


def rank_transformers_packed(out_features: int, in_features: int, experts: int):
    """Hugging Face's own packed styles shard real weights (``shard_param``: distribute_tensor without a
    source rank, as on the meta device), and its checkpoint loader cuts this rank's piece of the full
    weight (``DtensorShardOperation``): both pieces, and the layouts."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.sharding_utils import DtensorShardOperation
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES  # (its import registers them)

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    g = torch.Generator().manual_seed(11)
    out = {}
    linear = torch.nn.Linear(in_features, out_features)
    experts_holder = torch.nn.Module()
    experts_holder.gate_up_proj = torch.nn.Parameter(torch.randn(experts, out_features, in_features, generator=g))
    experts_holder.down_proj = torch.nn.Parameter(torch.randn(experts, in_features, out_features, generator=g))
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=g))
        linear.bias.copy_(torch.randn(out_features, generator=g))
    targets = [("packed_colwise", linear, "weight"), ("packed_colwise", linear, "bias"),
               ("packed_colwise", experts_holder, "gate_up_proj"), ("packed_rowwise", experts_holder, "down_proj")]
    for style, module, name in targets:
        full = module._parameters[name].detach().clone()
        ALL_PARALLEL_STYLES[style].shard_param(module, name, mesh)
        p = module._parameters[name]
        try:
            loaded = DtensorShardOperation(p).shard_tensor(full)
        except IndexError as exc:  # transformers 5.24.0 cannot load an empty strided piece (see the test)
            loaded = f"{type(exc).__name__}: {exc}"
        out[f"{style}:{name}"] = {"layout": pickle.dumps(placement_of(p)), "local": p.to_local().detach().clone(),
                                  "loaded": loaded, "original": full, "placement": str(p.placements[0])}
    return out


def rank_trained_pieces(intermediate: int):
    """A Hugging Face MoE block (packed_colwise experts: a _StridedShard gate/up weight) and a Replicate weight
    whose grad DTensor leaves Partial, after backward and an AdamW step: each DTensor's layout and local piece,
    and its full_tensor() (the same data, gathered by torch) for the parameter, its grad and its trained value."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    config = Qwen3MoeConfig(hidden_size=6, moe_intermediate_size=intermediate, num_experts=3, num_experts_per_tok=2)
    block = Qwen3MoeSparseMoeBlock(config).double()
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, dtype=p.dtype))
    apply_tensor_parallelism(block, mesh, {"experts.gate_up_proj": "packed_colwise", "experts.down_proj": "rowwise",
                                           "experts": "moe_tp_experts"})
    block(torch.randn(1, 5, 6, dtype=torch.double)).sum().backward()
    # integers: the Partial grad's sum is exact in any order
    scale = torch.nn.Parameter(distribute_tensor(torch.arange(3.0), mesh))
    x = distribute_tensor(torch.arange(24.0).reshape(8, 3), mesh, [Shard(0)])
    (x * scale).sum().backward()
    params = {**dict(block.experts.named_parameters()), "scale": scale}
    out = {}
    for when in ("grad", "trained"):
        if when == "trained":
            torch.optim.AdamW(params.values(), lr=0.1).step()
        for name, p in params.items():
            t = p.grad if when == "grad" else p
            assert isinstance(t, DTensor), (name, when, type(t))
            out[f"{name}:{when}"] = {"layout": pickle.dumps(placement_of(t)), "local": t.to_local().detach().clone(),
                                     "full_tensor": t.full_tensor().detach().clone()}
    return out


def _check_world(results, cases):
    for i, (shape, placements) in enumerate(cases):
        layouts = [pickle.loads(v[i]["layout"]) for v in results]
        assert all(lay == layouts[0] for lay in layouts), f"ranks disagree on the layout of {placements}"
        layout = layouts[0]
        assert layout.shape == shape
        pieces = {r: v[i]["local"] for r, v in enumerate(results)}
        original = results[0][i]["original"]
        full = assemble(pieces, layout)
        what = f"{placements} over mesh {layout.mesh_shape}, shape {shape}"
        assert full.dtype == original.dtype and torch.equal(full, original), what
        for r, v in enumerate(results):
            if (shape, placements) in TORCH_GATHER_WRONG:
                assert not torch.equal(full, v[i]["full_tensor"]), f"{what}: torch now gathers it right"
            elif isinstance(v[i]["full_tensor"], torch.Tensor):
                assert torch.equal(full, v[i]["full_tensor"]), f"{what}: full_tensor() on rank {r}"
            else:
                assert "avg" in str(placements), v[i]["full_tensor"]  # gloo has no average
            assert piece_shape(layout, r) == tuple(v[i]["local"].shape), f"{what}: shape on rank {r}"
            assert torch.equal(expected_piece(original, layout, r), v[i]["local"]), f"{what}: piece of rank {r}"
        assert diverging_replicas(pieces, layout) == []
        uneven_strided = any(p.kind == "strided_shard" for p in layout.placements) and len(
            {piece_shape(layout, r) for r in range(len(results))}) > 1
        assert results[0][i]["scattered"] != uneven_strided, f"{what}: scattered={results[0][i]['scattered']}"


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield


@pytest.mark.gloo
@pytest.mark.parametrize("ws", [2, 4])
def test_gloo_1d_mesh_every_placement(ws):
    results = tpsim.run(rank_distribute, ws, backend="gloo", args=(CASES_1D, (ws,)), timeout=120)
    _check_world(results, CASES_1D)


@pytest.mark.gloo
def test_gloo_2d_mesh_every_placement():
    results = tpsim.run(rank_distribute, 4, backend="gloo", args=(CASES_2D, (2, 2)), timeout=120)
    _check_world(results, CASES_2D)
    # torch's docstring table for FSDP over TP: (dp, tp) coordinate -> row block of 2 rows
    layout = pickle.loads(results[0][CASES_2D.index(((8, 6), ("SS0/2", "S0")))]["layout"])
    assert [piece_runs(layout, r)[0] for r in range(4)] == [((0, 2),), ((4, 6),), ((2, 4),), ((6, 8),)]


@pytest.mark.gloo
@pytest.mark.parametrize("ws", [2, 4])
def test_gloo_transformers_packed_styles(ws):
    # 10 packed rows over 4 ranks: uneven halves of 5 (2, 2, 1, 0 of each half)
    results = tpsim.run(rank_transformers_packed, ws, backend="gloo", args=(10, 3, 2), timeout=180)
    for key in results[0]:
        layout = pickle.loads(results[0][key]["layout"])
        pieces = {r: v[key]["local"] for r, v in enumerate(results)}
        original = results[0][key]["original"]
        assert torch.equal(assemble(pieces, layout), original), key
        for r, v in enumerate(results):
            assert torch.equal(expected_piece(original, layout, r), v[key]["local"]), f"{key} on rank {r}"
            if v[key]["local"].numel() == 0 and "_S(" in v[key]["placement"]:
                # transformers 5.24.0's checkpoint loader fails on a rank whose strided piece is empty (10 packed
                # rows over 4 ranks: rank 3 holds none) instead of loading nothing
                assert v[key]["loaded"] == "IndexError: list index out of range", f"{key} on rank {r}"
            else:
                assert torch.equal(v[key]["loaded"], v[key]["local"]), f"{key}: transformers' loader on rank {r}"
    assert results[0]["packed_colwise:weight"]["placement"] == "_S(0, 2)"
    assert results[0]["packed_colwise:bias"]["placement"] == "S(0)"
    assert results[0]["packed_colwise:gate_up_proj"]["placement"] == "_S(1, 2)"
    assert results[0]["packed_rowwise:down_proj"]["placement"] == "_S(2, 2)"


@pytest.mark.gloo
@pytest.mark.parametrize("ws", [2, 4])
def test_gloo_grads_and_trained_values_read_through_their_placement(ws):
    # 2 * 5 packed rows over 4 ranks: uneven, the last rank's piece empty
    results = tpsim.run(rank_trained_pieces, ws, backend="gloo", args=(5,), timeout=180)
    want = {"gate_up_proj": "(_S(1, 2))", "down_proj": "(S(2))", "scale": "(R)"}
    for key in results[0]:
        layout = pickle.loads(results[0][key]["layout"])
        name, when = key.split(":")
        # a grad keeps its parameter's placement (a strided one too), except the Replicate weight's: Partial
        assert str(layout).startswith("(P(sum))" if key == "scale:grad" else want[name]), (key, str(layout))
        full = assemble({r: v[key]["local"] for r, v in enumerate(results)}, layout)
        for r, v in enumerate(results):
            assert torch.equal(full, v[key]["full_tensor"]), f"{key}: full_tensor() on rank {r}"


# --- without a world: torch's split functions as the oracle -----------------------------------------


def _torch_pieces(full: torch.Tensor, layout: DTensorLayout) -> dict[int, torch.Tensor]:
    """Every rank's piece as distribute_tensor computes it, from torch's own split functions."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    out = {}
    for rank in layout.ranks:
        t = full
        for mesh_dim, (pl, c) in enumerate(zip(layout.placements, layout.coordinate(rank), strict=True)):
            n = layout.mesh_shape[mesh_dim]
            if pl.kind == "shard":
                t = Shard(pl.dim)._split_tensor(t, n, with_padding=False)[0][c]
            elif pl.kind == "strided_shard":
                t = _StridedShard(pl.dim, split_factor=pl.split_factor)._split_tensor(t, n, with_padding=False)[0][c]
            elif pl.kind == "partial" and pl.reduce_op == "sum":  # Partial._partition_value: avg/max keep the value
                t = t / n
        out[rank] = t.contiguous()
    return out


@st.composite
def layouts(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(0, 11), min_size=ndim, max_size=ndim)))
    mesh_shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    partial_op = draw(st.sampled_from(["sum", "avg", "max"]))
    placements = []
    for _ in mesh_shape:
        kind = draw(st.sampled_from(["shard", "strided_shard", "replicate", "partial"]))
        if kind in ("shard", "strided_shard"):
            sf = draw(st.integers(1, 4)) if kind == "strided_shard" else 1
            placements.append(MeshPlacement(kind, dim=draw(st.integers(0, ndim - 1)), split_factor=sf))
        elif kind == "partial":
            placements.append(MeshPlacement(kind, reduce_op=partial_op))
        else:
            placements.append(MeshPlacement(kind))
    ranks = draw(st.permutations(range(int(torch.tensor(mesh_shape).prod()))))
    return DTensorLayout(shape, mesh_shape, tuple(ranks), tuple(placements))


@given(layouts(), st.integers(0, 2**16))
def test_pieces_match_torch_split_and_assemble_inverts(layout, seed):
    g = torch.Generator().manual_seed(seed)
    # integer multiples of 4**3 * 3**3: a Partial sum's division by up to three mesh dims of 2, 3 or 4
    # ranks, and the sum of the terms, are exact
    full = (torch.randint(-20, 20, layout.shape, generator=g) * 1728).double()
    ours = {r: expected_piece(full, layout, r) for r in layout.ranks}
    theirs = _torch_pieces(full, layout)
    for r in layout.ranks:
        assert torch.equal(ours[r], theirs[r]), f"rank {r} of {layout}"
        assert piece_shape(layout, r) == tuple(ours[r].shape)
    assert torch.equal(assemble(ours, layout), full), str(layout)
    assert diverging_replicas(ours, layout) == []


# --- hand-made pieces ---------------------------------------------------------------------------------


def _layout(shape, *placements, mesh_shape=None, ranks=None):
    mesh_shape = mesh_shape or (4,)
    ranks = ranks or tuple(range(int(torch.tensor(mesh_shape).prod())))
    return DTensorLayout(tuple(shape), tuple(mesh_shape), tuple(ranks), tuple(placements))


def test_strided_shard_docstring_example():
    # torch's _StridedShard._to_replicate_tensor docstring: 9 elements, split_factor 2, 4 ranks
    layout = _layout((9,), MeshPlacement("strided_shard", dim=0, split_factor=2))
    pieces = [torch.tensor([0, 1, 5]), torch.tensor([2, 3, 6]), torch.tensor([4, 7]), torch.tensor([8])]
    assert [piece_runs(layout, r) for r in range(4)] == [
        (((0, 2), (5, 6)),), (((2, 4), (6, 7)),), (((4, 5), (7, 8)),), (((8, 9),),)]
    assert torch.equal(assemble(pieces, layout), torch.arange(9))
    for r in range(4):
        assert torch.equal(expected_piece(torch.arange(9), layout, r), pieces[r])


def test_shard_uses_chunk_sizes():
    layout = _layout((5, 2), MeshPlacement("shard", dim=0))
    assert [piece_shape(layout, r) for r in range(4)] == [(2, 2), (2, 2), (1, 2), (0, 2)]
    full = torch.arange(10.0).reshape(5, 2)
    pieces = {r: full[[slice(0, 2), slice(2, 4), slice(4, 5), slice(5, 5)][r]] for r in range(4)}
    assert torch.equal(assemble(pieces, layout), full)


def test_partial_sum_and_ranks_keyed_by_global_rank():
    # a mesh of global ranks 4..7 (a tp group of a larger world), laid out 7, 6, 5, 4
    layout = _layout((2, 3), MeshPlacement("partial", reduce_op="sum"), ranks=(7, 6, 5, 4))
    pieces = {r: torch.full((2, 3), float(r)) for r in (4, 5, 6, 7)}
    assert torch.equal(assemble(pieces, layout), torch.full((2, 3), 22.0))
    assert torch.equal(expected_piece(torch.full((2, 3), 8.0), layout, 5), torch.full((2, 3), 2.0))
    assert layout.coordinate(7) == (0,) and layout.coordinate(4) == (3,)


def test_partial_reductions():
    pieces = [torch.tensor([1.0, -4.0]), torch.tensor([3.0, 2.0])]
    for op, want in (("max", [3.0, 2.0]), ("min", [1.0, -4.0]), ("avg", [2.0, -1.0]), ("product", [3.0, -8.0])):
        layout = _layout((2,), MeshPlacement("partial", reduce_op=op), mesh_shape=(2,))
        assert torch.equal(assemble(pieces, layout), torch.tensor(want)), op
    with pytest.raises(InvalidArgument, match=r"Partial\(product\).*assemble"):
        expected_piece(torch.ones(2), _layout((2,), MeshPlacement("partial", reduce_op="product"), mesh_shape=(2,)), 0)


def test_replicate_reads_coordinate_zero_and_names_diverging_copies():
    # (Replicate, Shard(0)) on a 2 x 2 mesh: ranks 0 and 2 hold rows 0-1, ranks 1 and 3 rows 2-3
    layout = _layout((4,), MeshPlacement("replicate"), MeshPlacement("shard", dim=0), mesh_shape=(2, 2))
    full = torch.tensor([1.0, 2.0, 3.0, 4.0])
    pieces = {r: expected_piece(full, layout, r) for r in range(4)}
    assert diverging_replicas(pieces, layout) == []
    pieces[3] = torch.tensor([3.0, 5.0])
    assert torch.equal(assemble(pieces, layout), full)  # read from coordinate 0 of the Replicate dim
    assert diverging_replicas(pieces, layout) == [(3, 1)]
    nan = {r: torch.full((2,), float("nan")) for r in range(4)}
    assert diverging_replicas(nan, layout) == []  # equal bits, though NaN != NaN


def test_zero_size_and_scalar():
    layout = _layout((0, 3), MeshPlacement("strided_shard", dim=0, split_factor=2))
    assert all(piece_shape(layout, r) == (0, 3) for r in range(4))
    assert assemble([torch.empty(0, 3)] * 4, layout).shape == (0, 3)
    scalar = _layout((), MeshPlacement("partial", reduce_op="sum"), mesh_shape=(2,))
    assert torch.equal(assemble([torch.tensor(1.5), torch.tensor(2.0)], scalar), torch.tensor(3.5))


def test_layout_is_plain_data():
    layout = _layout((8, 6), MeshPlacement("strided_shard", dim=0, split_factor=2), MeshPlacement("shard", dim=1),
                     mesh_shape=(2, 2))
    assert pickle.loads(pickle.dumps(layout)) == layout
    assert str(layout) == "(_S(0, 2), S(1)) on mesh (2, 2), shape (8, 6)"
    assert [str(p) for p in (MeshPlacement("replicate"), MeshPlacement("partial", reduce_op="sum"))] == ["R", "P(sum)"]


def test_bad_pieces_are_refused_by_name():
    layout = _layout((5, 2), MeshPlacement("shard", dim=0))
    good = [torch.zeros(s) for s in [(2, 2), (2, 2), (1, 2), (0, 2)]]
    with pytest.raises(InvalidArgument, match=r"ranks \[0, 1, 2\].*\[0, 1, 2, 3\]"):
        assemble(good[:3], layout)
    bad = good[:2] + [torch.zeros(2, 2), good[3]]
    with pytest.raises(PieceShapeMismatch, match=r"rank 2 holds a piece of shape \(2, 2\).*rank 2 shape \(1, 2\)") as e:
        assemble(bad, layout)
    again = pickle.loads(pickle.dumps(e.value))
    assert (again.rank, again.shape, again.expected) == (2, (2, 2), (1, 2)) and str(again) == str(e.value)
    with pytest.raises(InvalidArgument, match=r"different dtypes"):
        assemble([g.double() if i else g for i, g in enumerate(good)], layout)
    with pytest.raises(InvalidArgument, match=r"full has shape \(4, 2\).*expects \(5, 2\)"):
        expected_piece(torch.zeros(4, 2), layout, 0)
    with pytest.raises(InvalidArgument, match=r"rank=9 is not on this DTensor's mesh"):
        expected_piece(torch.zeros(5, 2), layout, 9)


@pytest.mark.parametrize("kwargs, message", [
    ({"kind": "shard"}, r"a shard names the tensor dim"),
    ({"kind": "replicate", "dim": 0}, r"a shard names the tensor dim"),
    ({"kind": "shard", "dim": -1}, r"dim=-1.*int >= 0"),
    ({"kind": "strided_shard", "dim": 0, "split_factor": 0}, r"split_factor=0"),
    ({"kind": "shard", "dim": 0, "split_factor": 2}, r"1 unless the placement is a strided shard"),
    ({"kind": "partial"}, r"a partial names its reduction"),
    ({"kind": "partial", "reduce_op": "median"}, r"reduce_op='median'"),
    ({"kind": "mask"}, r"kind='mask'.*expected one of"),
])
def test_bad_placements_are_refused(kwargs, message):
    with pytest.raises(InvalidArgument, match=message):
        MeshPlacement(**kwargs)


def test_bad_layouts_are_refused():
    s0 = MeshPlacement("shard", dim=0)
    with pytest.raises(InvalidArgument, match=r"expected 4 distinct ranks"):
        DTensorLayout((4,), (4,), (0, 1, 2, 2), (s0,))
    with pytest.raises(InvalidArgument, match=r"one placement per mesh dim"):
        DTensorLayout((4,), (2, 2), (0, 1, 2, 3), (s0,))
    with pytest.raises(InvalidArgument, match=r"cuts dim 1 of a tensor of shape \(4,\)"):
        DTensorLayout((4,), (4,), (0, 1, 2, 3), (MeshPlacement("shard", dim=1),))
    with pytest.raises(InvalidArgument, match=r"different reductions \['max', 'sum'\]"):
        DTensorLayout((4,), (2, 2), (0, 1, 2, 3),
                      (MeshPlacement("partial", reduce_op="sum"), MeshPlacement("partial", reduce_op="max")))


def rank_refused_layouts():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _MaskPartial

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out = []
    for p in (DTensor.from_local(torch.zeros(2), mesh, [_MaskPartial()], run_check=False), torch.zeros(2)):
        try:
            placement_of(p)
        except InvalidArgument as exc:
            out.append((type(exc).__name__, str(exc)))
    return out


def test_placement_of_refuses_what_it_does_not_read():
    [(kind, text), (kind2, text2)] = tpsim.run(rank_refused_layouts, 1)[0]
    assert kind == UnsupportedLayout.__name__ and "_MaskPartial" in text and "Shard, _StridedShard" in text
    assert kind2 == "InvalidArgument" and "expected a DTensor, got Tensor" in text2


def test_reading_pieces_does_not_import_dtensor():
    # The judging process assembles what workers shipped without paying for torch.distributed.tensor.
    code = ("import sys, torch\n"
            "from tpsim.props.module.dtensor_pieces import DTensorLayout, MeshPlacement, assemble, expected_piece\n"
            "lay = DTensorLayout((4,), (2,), (0, 1), (MeshPlacement('strided_shard', dim=0, split_factor=2),))\n"
            "full = torch.arange(4.0)\n"
            "assert torch.equal(assemble([expected_piece(full, lay, r) for r in (0, 1)], lay), full)\n"
            "print('torch.distributed.tensor' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
