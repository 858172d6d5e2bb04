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

__all__ = ["TPSIM_VARIANTS", "column", "column_gathered", "row", "row_scatter"]

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

#: What ``tpsim check tpsim.layers`` checks.
TPSIM_VARIANTS = [column, column_gathered, row, row_scatter]
