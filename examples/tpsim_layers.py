"""tpsim's own layers, described as variants with explicit placements.

``tpsim check tpsim.layers`` checks these layers already (their variants are declared in
``tpsim/builtin_variants.py``); this file spells the same descriptions out, placement by
placement, as a template for layers built the Megatron way (a builder that constructs the layer
with its tp ``group`` and ``dtype``; tpsim then loads the master shards into its parameters)::

    tpsim check examples/tpsim_layers.py
    tpsim check examples/tpsim_layers.py:row --backend gloo --world-sizes 2,3

Placements are in master coordinates: the weight as ``[out_features, in_features]`` like
``nn.Linear``, so a column weight is ``Shard(0)`` and a row weight ``Shard(1)``.
"""

from __future__ import annotations

from tpsim.layers import ColumnParallelLinear, RowParallelLinear
from tpsim.placement import Replicate, Shard
from tpsim.variant import ParamSpec, Variant


def build_column(in_features, out_features, bias, *, group, dtype, **_):
    return ColumnParallelLinear(in_features, out_features, bias, group=group, dtype=dtype)


def build_row(in_features, out_features, bias, *, group, dtype, **_):
    return RowParallelLinear(in_features, out_features, bias, group=group, input_is_parallel=True, dtype=dtype)


column = Variant(
    name="layers.column",
    kind="column",
    build=build_column,
    input="replicated",  # the full input on every rank
    output="sharded",  # this rank's slice of the output features
    input_grad="complete",  # backward all-reduces the input grad (Megatron's rule)
    params=(
        ParamSpec("weight", "weight", Shard(0)),  # [out/ws, in]
        ParamSpec("bias", "bias", Shard(0)),  # [out/ws]
    ),
)

row = Variant(
    name="layers.row",
    kind="row",
    build=build_row,
    input="sharded",  # this rank's slice of the input features
    output="reduced",  # the layer all-reduces; the full output on every rank
    params=(
        ParamSpec("weight", "weight", Shard(1)),  # [out, in/ws]
        ParamSpec("bias", "bias", Replicate()),  # [out] on every rank, added once after the reduction
    ),
)

TPSIM_VARIANTS = [column, row]
