"""PyTorch's own tensor parallelism, checked by tpsim: ``nn.Linear`` under ``ColwiseParallel``.

Each variant builds a plain ``nn.Linear`` from the master weight on every rank, then hands it to
``torch.distributed.tensor.parallel.parallelize_module`` on a 1-D ``DeviceMesh`` over the tp
group: exactly what a user's training script does. Check them with::

    tpsim check examples/dtensor_colwise.py                 # every variant below, inproc
    tpsim check examples/dtensor_colwise.py:ColwiseParallel --backend gloo

DTensor parameters report their *global* shape, while tpsim's variant description names the
per-rank shard; ``LocalShards`` (in ``dtensor_common.py``, shared by the ``dtensor_*`` examples) exposes each
parameter's local shard, with its gradient, under ``local.<name>``. Layouts:

=======================  ===============================================  ============================
variant                  torch style                                      tpsim: input -> output
=======================  ===============================================  ============================
``ColwiseParallel``      ``ColwiseParallel()``                            replicated -> sharded
``ColwiseReplicateOut``  ``ColwiseParallel(output_layouts=Replicate())``  replicated -> gathered
``ColwiseDTensorOut``    ``ColwiseParallel(use_local_output=False)``,     replicated -> gathered
                         output read with ``full_tensor()``
``ColwiseShardedIn``     ``ColwiseParallel(input_layouts=Shard(-1),``     sharded -> full output
                         ``output_layouts=Replicate())``
=======================  ===============================================  ============================

The last one takes a sharded input, which tpsim's description only allows for ``kind="row"``; it
is declared as a row-kind layer whose weight is ``S(0)`` (the placements, not the kind, drive the
checks).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel as _ColwiseParallel

from tpsim.placement import Shard as TpShard
from tpsim.variant import ParamSpec, Variant

# The dtensor_* examples share their adapter in dtensor_common.py next to this file; tpsim imports
# example files by path (also inside gloo workers), so make the folder importable.
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
from dtensor_common import LocalShards, parallel_linear  # noqa: E402

__all__ = ["TPSIM_VARIANTS"]


def _builder(make_style: Any, output: str = "local") -> Any:
    def build(in_features: int, out_features: int, bias: bool, *, group: Any, master_weight: torch.Tensor,
              master_bias: torch.Tensor | None, dtype: torch.dtype, **_: Any) -> nn.Module:
        linear = parallel_linear(in_features, out_features, bias, group=group, master_weight=master_weight,
                                 master_bias=master_bias, dtype=dtype, style=make_style())
        return LocalShards(linear, output)

    return build


# The harness reads and loads parameters through ``local.*`` (the shard), in master layout.
_COLUMN_PARAMS = (
    ParamSpec("local.weight", "weight", TpShard(0)),
    ParamSpec("local.bias", "bias", TpShard(0)),
)

ColwiseParallel = Variant(
    name="ColwiseParallel",
    kind="column",
    build=_builder(_ColwiseParallel),
    input="replicated",
    output="sharded",
    params=_COLUMN_PARAMS,
    description="nn.Linear + ColwiseParallel(): replicated input, local output shard (use_local_output=True)",
)
ColwiseReplicateOut = Variant(
    name="ColwiseReplicateOut",
    kind="column",
    build=_builder(lambda: _ColwiseParallel(output_layouts=Replicate())),
    input="replicated",
    output="gathered",
    params=_COLUMN_PARAMS,
    description="nn.Linear + ColwiseParallel(output_layouts=Replicate()): the output all-gathered by DTensor",
)
ColwiseDTensorOut = Variant(
    name="ColwiseDTensorOut",
    kind="column",
    build=_builder(lambda: _ColwiseParallel(use_local_output=False), output="full"),
    input="replicated",
    output="gathered",
    params=_COLUMN_PARAMS,
    description="nn.Linear + ColwiseParallel(use_local_output=False): a DTensor output, read with full_tensor()",
)
ColwiseShardedIn = Variant(
    name="ColwiseShardedIn",
    kind="row",
    build=_builder(lambda: _ColwiseParallel(input_layouts=Shard(-1), output_layouts=Replicate())),
    input="sharded",
    output="reduced",
    params=_COLUMN_PARAMS,
    description="nn.Linear + ColwiseParallel with a feature-sharded input (all-gathered by DTensor) and a "
    "replicated output; declared row-kind because tpsim's column kind takes a replicated input",
)

TPSIM_VARIANTS = [ColwiseParallel, ColwiseReplicateOut, ColwiseDTensorOut, ColwiseShardedIn]
