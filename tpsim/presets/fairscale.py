"""The fairscale preset: ``tpsim check fairscale.nn.model_parallel.layers`` and subclasses of its layers.

Tested with ``fairscale==0.4.13``. Its ``ColumnParallelLinear(in_features, out_features, bias=True,
gather_output=True)`` and ``RowParallelLinear(in_features, out_features, bias=True,
input_is_parallel=False)`` read the tp group from a module global of
``fairscale.nn.model_parallel.initialize``, set by ``initialize_model_parallel(size)``. For each
rank the preset resets that state and calls ``initialize_model_parallel(world_size)`` (the
library's own init, which prints ``> initializing model parallel with size N`` on rank 0: captured
per rank, shown only under a failure), then constructs the layer with its own init, weight ``[out/tp, in]`` (column) / ``[out, in/tp]``
(row), and tpsim writes the case's pieces by those declared layouts. fairscale has no loader that
cuts full weights: its checkpoints are one state dict per rank, saved and loaded whole, and the only
code of its own that slices a full weight is its init (``_initialize_affine_weight``), which builds
the full weight in the layer's construction dtype (float32) and so could not carry a float64 case.

``initialize`` is rank-local on inproc: each rank thread has its own copy of its globals, as each
process does in a real job. The library lays its tp groups out as consecutive ranks and its layers
take no group argument, so the preset checks one tp group spanning the world (``subgroups=False``).
fairscale takes inputs of any number of batch dims.
"""

from __future__ import annotations

from typing import Any

from tpsim.conventions import own_module_state
from tpsim.placement import Replicate, Shard
from tpsim.presets._base import LibraryMissing, option_name, quiet_import, route_rank_warnings
from tpsim.variant import ParamSpec, Variant

__all__ = ["PRESET", "FairscalePreset"]

_LAYERS = "fairscale.nn.model_parallel.layers"
_INITIALIZE = "fairscale.nn.model_parallel.initialize"
_COLUMN = f"{_LAYERS}.ColumnParallelLinear"
_ROW = f"{_LAYERS}.RowParallelLinear"
_COLUMN_DEFAULTS = {"gather_output": True}
_ROW_DEFAULTS = {"input_is_parallel": False}


def _init_model_parallel(world_size: int) -> None:
    from fairscale.nn.model_parallel import initialize

    # A fresh state per build: a gloo worker process is reused across cases, and its last
    # case's groups are gone.
    initialize.destroy_model_parallel()
    initialize.initialize_model_parallel(world_size)


def _builder(cls: type, options: dict[str, Any]):
    def build(in_features, out_features, bias, *, group, rank, world_size, master_weight, master_bias, dtype):
        _init_model_parallel(world_size)
        return cls(in_features, out_features, bias=bias, **options).to(dtype)

    return build


class FairscalePreset:
    """fairscale's ``ColumnParallelLinear`` and ``RowParallelLinear`` (see the module docstring)."""

    name = "fairscale"
    requirement = "fairscale==0.4.13"
    targets = ("fairscale.nn.model_parallel", _LAYERS)
    classes = {_COLUMN: "column", _ROW: "row"}
    rank_local = (_INITIALIZE,)

    def load(self) -> dict[str, type]:
        layers = quiet_import(self, _LAYERS)
        quiet_import(self, _INITIALIZE)
        route_rank_warnings()
        try:
            return {_COLUMN: layers.ColumnParallelLinear, _ROW: layers.RowParallelLinear}
        except AttributeError as err:
            raise LibraryMissing(self, err) from err

    def variants(self, cls: type, kind: str) -> list[Variant]:
        self.load()
        own = () if cls.__module__.startswith("fairscale.") else own_module_state(cls.__module__)
        rank_local = (*self.rank_local, *own)
        description = f"{cls.__module__}.{cls.__qualname__} (fairscale preset)"
        if kind == "column":
            return [
                Variant(
                    name=option_name(cls, [("gather_output", g)], _COLUMN_DEFAULTS),
                    kind="column",
                    build=_builder(cls, {"gather_output": g}),
                    input="replicated",
                    output="gathered" if g else "sharded",
                    params=(ParamSpec("weight", "weight", Shard(0)), ParamSpec("bias", "bias", Shard(0))),
                    description=description,
                    subgroups=False,
                    rank_local=rank_local,
                )
                for g in (True, False)
            ]
        return [
            Variant(
                name=option_name(cls, [("input_is_parallel", p)], _ROW_DEFAULTS),
                kind="row",
                build=_builder(cls, {"input_is_parallel": p}),
                input="sharded" if p else "replicated",
                output="reduced",
                params=(ParamSpec("weight", "weight", Shard(1)), ParamSpec("bias", "bias", Replicate())),
                description=description,
                subgroups=False,
                rank_local=rank_local,
            )
            for p in (False, True)
        ]


PRESET = FairscalePreset()
