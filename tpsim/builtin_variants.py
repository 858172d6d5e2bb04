"""The variants of tpsim's own layers (:mod:`tpsim.layers`), as ``tpsim check tpsim.layers`` checks them.

The layer core must not import the harness (DESIGN.md: the same ``ColumnParallelLinear`` runs in a
real training job with no tpsim machinery around it), so its variant descriptions live here, and
the target resolver maps the bare target ``tpsim.layers`` to this module.

Every builder constructs the layer exactly as a user would (with the tp ``group`` and ``dtype``);
the generic loader then overwrites the layer's own initialisation with the master shards, by the
default placements: column weight/bias ``S(0)``, row weight ``S(1)`` and bias ``R``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from tpsim.layers import ColumnParallelLinear, RowParallelLinear
from tpsim.variant import Variant

__all__ = [
    "TPSIM_MLPS",
    "TPSIM_VARIANTS",
    "column",
    "column_gate_up",
    "column_gathered",
    "column_qkv_gathered",
    "column_qkv_gqa",
    "column_sequence_parallel",
    "row",
    "row_scatter",
    "row_sequence_parallel",
]

# Worker processes (gloo/nccl) re-resolve a variant from its target and name.
_TARGET = "tpsim.layers"


def _column(gather_output: bool):
    def build(in_features: int, out_features: int, bias: bool, *, group: Any, dtype: Any, **_: Any) -> nn.Module:
        return ColumnParallelLinear(in_features, out_features, bias, group=group, gather_output=gather_output, dtype=dtype)

    return build


def _row(input_is_parallel: bool):
    def build(in_features: int, out_features: int, bias: bool, *, group: Any, dtype: Any, **_: Any) -> nn.Module:
        return RowParallelLinear(
            in_features, out_features, bias, group=group, input_is_parallel=input_is_parallel, dtype=dtype
        )

    return build


column = Variant(
    name="ColumnParallelLinear",
    kind="column",
    build=_column(False),
    output="sharded",
    description="tpsim.layers.ColumnParallelLinear: replicated input, this rank's output slice",
    target=_TARGET,
)
column_gathered = Variant(
    name="ColumnParallelLinear(gather_output=True)",
    kind="column",
    build=_column(True),
    output="gathered",
    description="tpsim.layers.ColumnParallelLinear with gather_output=True: full output on every rank",
    target=_TARGET,
)
row = Variant(
    name="RowParallelLinear",
    kind="row",
    build=_row(True),
    input="sharded",
    output="reduced",
    description="tpsim.layers.RowParallelLinear: this rank's input slice, all-reduced output, bias added once",
    target=_TARGET,
)
row_scatter = Variant(
    name="RowParallelLinear(input_is_parallel=False)",
    kind="row",
    build=_row(False),
    input="replicated",
    output="reduced",
    description="tpsim.layers.RowParallelLinear with input_is_parallel=False: splits the full input itself",
    target=_TARGET,
)



# --- packed weights and sequence parallelism (issue 12) -------------------------------------------


def _packed_column(gather_output: bool):
    # ``parts`` comes from the variant's ``packed`` proportions, scaled to the case's out_features.
    def build(in_features: int, out_features: int, bias: bool, *, group: Any, dtype: Any, parts: Any = None,
              **_: Any) -> nn.Module:
        return ColumnParallelLinear(in_features, out_features, bias, group=group, gather_output=gather_output,
                                    parts=parts, dtype=dtype)

    return build


def _sequence_column(in_features: int, out_features: int, bias: bool, *, group: Any, dtype: Any,
                     sequence_dim: int = -2, **_: Any) -> nn.Module:
    return ColumnParallelLinear(in_features, out_features, bias, group=group, sequence_parallel=True,
                                sequence_dim=sequence_dim, dtype=dtype)


def _sequence_row(in_features: int, out_features: int, bias: bool, *, group: Any, dtype: Any,
                  sequence_dim: int = -2, **_: Any) -> nn.Module:
    return RowParallelLinear(in_features, out_features, bias, group=group, input_is_parallel=True,
                             sequence_parallel=True, sequence_dim=sequence_dim, dtype=dtype)


column_gate_up = Variant(
    name="ColumnParallelLinear(parts=gate,up)",
    kind="column",
    build=_packed_column(False),
    output="sharded",
    packed=(1, 1),
    description="tpsim.layers.ColumnParallelLinear packing gate and up (K=2): rank r holds shard r of each",
    target=_TARGET,
)
column_qkv_gqa = Variant(
    name="ColumnParallelLinear(parts=q8,k2,v2)",
    kind="column",
    build=_packed_column(False),
    output="sharded",
    packed=(8, 2, 2),
    description="tpsim.layers.ColumnParallelLinear packing Q, K, V for grouped-query attention (8:2:2 heads)",
    target=_TARGET,
)
column_qkv_gathered = Variant(
    name="ColumnParallelLinear(parts=q8,k2,v2, gather_output=True)",
    kind="column",
    build=_packed_column(True),
    output="gathered",
    packed=(8, 2, 2),
    description="packed grouped-query QKV with gather_output=True: the gathered output is back in part order",
    target=_TARGET,
)
column_sequence_parallel = Variant(
    name="ColumnParallelLinear(sequence_parallel=True)",
    kind="column",
    build=_sequence_column,
    input="sequence-sharded",
    output="sharded",
    description="tpsim.layers.ColumnParallelLinear with sequence_parallel=True: all-gathers the sequence-sharded "
    "input, reduce-scatters its grad",
    target=_TARGET,
)
row_sequence_parallel = Variant(
    name="RowParallelLinear(sequence_parallel=True)",
    kind="row",
    build=_sequence_row,
    input="sharded",
    output="sequence-sharded",
    description="tpsim.layers.RowParallelLinear with sequence_parallel=True: reduce-scatters along the sequence, "
    "bias added once per sequence shard, its grad all-reduced",
    target=_TARGET,
)

#: What ``tpsim check tpsim.layers`` checks (``column_qkv_gathered`` is left out to keep that job
#: fast; tests/test_packed.py checks it).
TPSIM_VARIANTS = [
    column,
    column_gathered,
    row,
    row_scatter,
    column_gate_up,
    column_qkv_gqa,
    column_sequence_parallel,
    row_sequence_parallel,
]

#: The MLPs ``tpsim check tpsim.layers`` also checks against the dense MLP (see tpsim.props.mlp), as
#: plain data (this module must not import the harness): name, activation, sequence parallelism.
TPSIM_MLPS = [
    {"name": "ParallelMLP(swiglu)", "activation": "swiglu", "sequence_parallel": False},
    {"name": "ParallelMLP(swiglu, sequence_parallel=True)", "activation": "swiglu", "sequence_parallel": True},
]
